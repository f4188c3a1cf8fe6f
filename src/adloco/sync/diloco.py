"""DiLoCo (and LocalSGD, its outer SGD with lr 1 and no momentum): what happens at the end of a round.

Every worker ran H inner steps from θ with no communication. Now, in one collective per trainer, each worker
sends its drift Δ_m = θ − θ_m (encoded when a codec is set) together with its round report (losses, tokens,
health, batch statistics, b_max). The trainer averages Δ over the workers that stayed healthy, takes the outer
step θ ← OuterOpt(θ, Δ), and every worker restarts from θ with its inner AdamW state kept. A trainer whose
workers all failed skips its outer step. AdLoCo is this strategy plus the batch controller and merges, which
the cluster runs after the round from the reports.
"""

from __future__ import annotations

from adloco.sync.base import DeltaStrategy
from adloco.workers.reports import RoundState


class DiLoCoSync(DeltaStrategy):
    def end_of_round(self, state: RoundState) -> None:
        started = {
            trainer.trainer_id: self.exchange.start(
                trainer,
                0,
                self.workers,
                state.out,
                reports=state.local_tensors(self.hosted(trainer)),
                weights=state.weights,
            )
            for trainer in self.taking_part()
        }
        for trainer_id, future in started.items():
            trainer = self.trainers[trainer_id]
            exchanged = self.comm.wait(future)
            state.learn(exchanged.reports)
            if not self.mark_skipped(state, trainer):
                trainer.outer_step(0, self.applied(trainer, exchanged))
            trainer.broadcast(self.workers)
