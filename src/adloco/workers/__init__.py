"""A rank's workers: one worker, several stacked as one computation, one sharded over ranks, the engine that
runs them, their inner optimizer, the task they train on, the b_max probe and the reports a round leaves."""
