"""The training methods, each registered once: the sync strategy that runs it, what it fills in where a run gives
nothing, and its rules. The config, the Python API, the replicas, ``adloco estimate``, the integrations and the
generated docs read this registry; ``adloco.sync`` builds each method's strategy from its ``strategy`` name.

It lives in ``config/`` (below ``sync/``) because the config validates a method when it is made: the registry holds
plain data and plain functions over a config, and the strategy classes stay in ``sync/``, named here by family."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from adloco.errors import ConfigError


@dataclass(frozen=True)
class Method:
    """One training method: its sync strategy, its defaults and the properties its rules follow from.

    ``check`` takes the resolved config (a ``TrainConfig``: ``config.train`` imports this module, not the other way
    round) and raises ``ValueError`` with a one-line message for what the method cannot run."""

    name: str
    # the sync strategy family in adloco.sync: "ddp", "diloco" (overlapped with outer.overlap) or "streaming"
    strategy: str = "diloco"
    outer: tuple[float, float, bool] = (1.0, 0.5, True)  # outer SGD's lr, momentum and Nesterov where not given
    outer_fixed: bool = False  # the method is its outer step (DDP, LocalSGD): another lr, momentum, optimizer refused
    sync_every: int = 10  # H
    workers: int = 4  # per trainer
    trainers: int = 1
    batch_test: str = "constant"  # batch.test where not given
    batch_controller: str = "test"  # batch.controller where not given
    merge: str = "off"  # merge.policy where not given and there are several trainers
    adaptive_batch: bool = False  # AdLoCo's batch: its statistics measured, its section and budget handed to DiLoCo
    fragments: tuple[int, int, float] | None = None  # streaming.fragments, .overlap, .alpha; None: the whole model
    overlap: bool = False  # outer.overlap (delayed, eager) may overlap its whole-model rounds
    every_step: bool = False  # gradients averaged after every backward (DDP): no Δ, no outer step
    check: Callable[[Any], None] | None = None  # rules of its own, on the resolved config

    @property
    def sections(self) -> tuple[str, ...]:
        """The config sections a user's ``DiLoCo`` is given for this method only (the others it takes always)."""
        return (("streaming",) if self.fragments else ()) + (("batch",) if self.adaptive_batch else ())

    def syncs_per_round(self, sync_every: int) -> int:
        """Synchronisations in a round of ``sync_every`` inner steps: one exchange per step or one per round."""
        return sync_every if self.every_step else 1


METHODS: dict[str, Method] = {}  # in registration order: the order of the docs' columns and of the config's type


def register(method: Method) -> Method:
    """Add ``method`` to the registry (the config's ``method`` type is made from it when ``config.train`` is
    imported, so a method is registered in this module)."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


def method_named(name: Any) -> Method:
    """The registered method ``name``; for any other a one-line ConfigError that names the choices."""
    if not isinstance(name, str) or name not in METHODS:
        raise ConfigError(f"method: {name!r} is not one of {', '.join(METHODS)}")
    return METHODS[name]


def names(methods: Iterable[Method]) -> str:
    """``a``, ``a or b``, ``a, b or c``: method names for a message."""
    listed = [m.name for m in methods]
    return " or ".join(listed) if len(listed) < 3 else f"{', '.join(listed[:-1])} or {listed[-1]}"


def _every_step_rules(config: Any) -> None:
    """What a method that averages gradients after every backward cannot run: each needs a round's Δ or reports."""
    name = config.method
    if config.batch.test != "constant" or config.batch.controller != "test":
        raise ValueError(f"batch.test: {name} runs with a constant batch")
    if config.auto_sync:
        raise ValueError(f"sync_every: {name} averages gradients every step; auto chooses H for DiLoCo-family methods")
    if config.batch.shares == "speed":
        raise ValueError(f"batch.shares: {name} averages gradients every step; shares apply to DiLoCo-family methods")
    if config.codec.name != "none":
        raise ValueError(f"codec.name: {name} exchanges gradients every step; codecs apply to pseudo-gradients")
    if config.fault_tolerance.lighthouse is not None:
        others = (m for m in METHODS.values() if not m.every_step)
        raise ValueError(f"fault_tolerance: {name} averages gradients every step; replicas run {names(others)}")


register(Method("ddp", strategy="ddp", outer=(1.0, 0.0, False), outer_fixed=True, every_step=True,
                check=_every_step_rules))  # fmt: skip
register(Method("localsgd", outer=(1.0, 0.0, False), outer_fixed=True, overlap=True))
register(Method("diloco", overlap=True))
# One trainer of 4 workers: on the anchor task Multi-Instance Training (trainers=4 workers=1) ended 1.8-3.1 %
# above DiLoCo even from a shared init, one trainer 0.4-1.1 % (docs/batch-size.md); trainers=K merges.
register(Method("adloco", batch_test="norm", batch_controller="time", merge="b_req", adaptive_batch=True))
register(Method("streaming", strategy="streaming", fragments=(2, 1, 0.5)))
# SlowMo (Wang, Tantia, Ballas and Rabbat, "SlowMo: Improving Communication-Efficient Distributed SGD with Slow
# Momentum", ICLR 2020, arXiv 1910.00643): LocalSGD whose averaged drift an outer SGD applies with heavy-ball (not
# Nesterov) "slow momentum". lr 1 and momentum 0.5 are fairscale's SlowMoDistributedDataParallel defaults
# (slowmo_lr, slowmo_momentum). The paper divides Δ by the inner lr and multiplies the step by it back: the same
# update while the inner lr is constant; here, as in DiLoCo, the momentum adds up Δ as it comes.
register(Method("slowmo", outer=(1.0, 0.5, False), overlap=True))
