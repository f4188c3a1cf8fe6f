"""All trainers and their workers on this rank's side: placement of worker slots over ranks, the round loop,
the trainers' batches, merges and mirrors, and the cluster's checkpoint state."""
