"""What a user's own training loop holds: DiLoCo-family objects around their model and optimizer."""

from adloco.api.diloco import DiLoCo
from adloco.api.shutdown import end_process_group

__all__ = ["DiLoCo", "end_process_group"]
