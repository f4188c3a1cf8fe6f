"""adloco: low-communication distributed training of language models."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "DiLoCo",
    "Muon",
    "MuonWithAdamW",
    "end_process_group",
    "hidden_matrices",
    "train_parts",
    "TrainConfig",
    "TrainResult",
    "build_config",
    "load_config",
    "train",
    "__version__",
]

if TYPE_CHECKING:
    from adloco.api import DiLoCo, Muon, MuonWithAdamW, end_process_group, hidden_matrices, train_parts
    from adloco.config import TrainConfig, build_config, load_config
    from adloco.run.training import TrainResult, train


def __getattr__(name: str) -> Any:
    # Imported on first use, so `adloco --help` and `import adloco` stay fast (torch loads only when needed).
    if name in ("TrainConfig", "build_config", "load_config"):
        from adloco import config

        return getattr(config, name)
    if name in ("DiLoCo", "Muon", "MuonWithAdamW", "end_process_group", "hidden_matrices", "train_parts"):
        from adloco import api

        return getattr(api, name)
    if name in ("train", "TrainResult"):
        from adloco.run import training

        return getattr(training, name)
    raise AttributeError(f"module 'adloco' has no attribute {name!r}")
