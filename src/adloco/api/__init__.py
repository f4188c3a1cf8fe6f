"""What a user's own training loop holds: DiLoCo-family objects around their model and optimizer."""

from adloco.api.diloco import DiLoCo
from adloco.api.shutdown import end_process_group
from adloco.inner_optimizer import Muon, MuonWithAdamW, hidden_matrices

__all__ = ["DiLoCo", "Muon", "MuonWithAdamW", "end_process_group", "hidden_matrices"]
