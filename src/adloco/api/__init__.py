"""What a user's own training loop holds: DiLoCo-family objects around their model and optimizer."""

from adloco.api.diloco import DiLoCo

__all__ = ["DiLoCo"]
