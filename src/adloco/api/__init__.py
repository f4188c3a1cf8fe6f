"""What a user's own training loop holds: DiLoCo-family objects around their model and optimizer."""

from adloco.api.diloco import DiLoCo
from adloco.api.shutdown import end_process_group
from adloco.api.train_parts import TrainParts, train_parts
from adloco.workers.inner_optimizer import Muon, MuonWithAdamW, hidden_matrices

__all__ = ["DiLoCo", "Muon", "MuonWithAdamW", "TrainParts", "end_process_group", "hidden_matrices", "train_parts"]
