"""AdLoCo's adaptive part, a peer of the sync strategy: what a trainer's batch is, how it is decided at a round's
end, and how the inner optimizer follows it. ``adloco train`` and a user's own loop hold the same objects."""

from adloco.batch.policy import TrainerBatch, batch_coupling, pace_for

__all__ = ["TrainerBatch", "batch_coupling", "pace_for"]
