"""The method registry (adloco.config.methods): every method builds its strategy and trains a round, its defaults
and rules are the registry's, and nothing else in the package keeps a list of methods or branches on their names."""

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

import adloco
from adloco.api.settings import loop_settings
from adloco.api.train_parts import diloco_arguments
from adloco.cluster.cluster import Cluster
from adloco.comm.local import LocalCommunicator
from adloco.config import ConfigError, TrainConfig, build_config
from adloco.config.methods import METHODS, Method, register
from adloco.docs import configuration_markdown
from adloco.run.training import tokenizer_and_task
from adloco.sync import STRATEGIES, DDPSync, DiLoCoSync, OverlappedSync, StreamingSync
from adloco.tools.estimate import _syncs_per_round

TINY = ["model.context=16", "batch.size=2", "batch.memory.b_max=64", "threads=1", "run.progress=false", "workers=2"]
# what each strategy family a method may name builds (outer.overlap turns DiLoCo's into OverlappedSync)
FAMILIES = {"ddp": DDPSync, "diloco": DiLoCoSync, "streaming": StreamingSync}


def _cluster(overrides: list[str]) -> Cluster:
    config = build_config(overrides=[*TINY, *overrides])
    _, task = tokenizer_and_task(config, None)
    return Cluster(config, task, LocalCommunicator(), torch.device("cpu"))


def test_every_strategy_family_a_method_names_is_built_by_sync():
    assert set(STRATEGIES) == set(FAMILIES)
    assert {method.strategy for method in METHODS.values()} <= set(STRATEGIES)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_registered_method_builds_its_strategy_and_trains_a_round(name):
    cluster = _cluster([f"method={name}", "sync_every=4"])  # streaming: H/P above its overlap τ = 1
    assert type(cluster.sync) is FAMILIES[METHODS[name].strategy]
    (trainer,) = cluster.trainers.values()
    before = [t.clone() for t in trainer.theta]
    cluster.run_round(0, 4, lambda step: 1e-2)
    after = trainer.theta
    assert all(torch.isfinite(t).all() for t in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the round moved θ
    for worker in cluster.workers.values():  # every worker starts the next round from θ (streaming: its fragments)
        if not cluster.sync.saves_worker_params:
            assert all(torch.equal(p, t) for p, t in zip(worker.params, after, strict=True))


def test_a_method_that_overlaps_its_rounds_builds_the_overlapped_strategy():
    overlapping = next(m.name for m in METHODS.values() if m.overlap)
    assert type(_cluster([f"method={overlapping}", "outer.overlap=delayed"]).sync) is OverlappedSync


@pytest.mark.parametrize("name", list(METHODS))
def test_a_methods_defaults_are_the_registrys(name):
    method = METHODS[name]
    config = build_config({"method": name})
    lr, momentum, nesterov = method.outer
    assert (config.outer.lr, config.outer.momentum, config.outer.nesterov) == (lr, momentum, nesterov and momentum > 0)
    assert (config.sync_every, config.workers, config.trainers) == (method.sync_every, method.workers, method.trainers)
    assert (config.batch.test, config.batch.controller) == (method.batch_test, method.batch_controller)
    streaming = (config.streaming.fragments, config.streaming.overlap, config.streaming.alpha)
    assert streaming == (method.fragments or (1, 0, 0.0))
    several = build_config({"method": name, "trainers": 2, "workers": 1})
    assert several.merge.policy == method.merge and build_config({"method": name}).merge.policy == "off"


def test_the_config_reads_the_registry_when_it_validates(monkeypatch):
    """Defaults and the method's own check are read from the registry at validation, not copied at import."""
    changed = dataclasses.replace(METHODS["diloco"], outer=(0.25, 0.75, False), sync_every=6)
    monkeypatch.setitem(METHODS, "diloco", changed)
    config = build_config({"method": "diloco"})
    assert (config.outer.lr, config.outer.momentum, config.outer.nesterov, config.sync_every) == (0.25, 0.75, False, 6)

    def refuse_odd_h(config) -> None:
        if config.sync_every % 2:
            raise ValueError(f"sync_every: {config.method} wants an even H")

    monkeypatch.setitem(METHODS, "diloco", dataclasses.replace(changed, check=refuse_odd_h))
    with pytest.raises(ConfigError, match="sync_every: diloco wants an even H"):
        build_config({"method": "diloco", "sync_every": 5})


@pytest.mark.parametrize("name", list(METHODS))
def test_a_methods_rules_follow_its_registered_properties(name):
    method = METHODS[name]

    def refused(overrides: list[str]) -> bool:
        try:
            build_config(overrides=[f"method={name}", *overrides])
        except ConfigError:
            return True
        return False

    assert refused(["outer.lr=0.5"]) == method.outer_fixed
    assert refused(["outer.overlap=delayed"]) == (not method.overlap)
    assert refused(["streaming.fragments=2", "sync_every=4"]) == (method.fragments is None)
    assert refused(["batch.time.keep_round_time=true"]) == (method.fragments is not None)
    for every_step_only in (["codec.name=int8"], ["sync_every=auto"], ["batch.shares=speed"], ["batch.test=norm"]):
        assert refused(every_step_only) == method.every_step, every_step_only


def test_a_method_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        register(Method("diloco"))


def test_the_methods_config_api_replicas_estimate_and_docs_know_are_the_registrys():
    assert get_args(TrainConfig.model_fields["method"].annotation) == tuple(METHODS)
    table = "| key | " + " | ".join(METHODS) + " |"  # the reference's defaults per method, a column each
    assert table in configuration_markdown()
    task = SimpleNamespace(context=16)
    for name, method in METHODS.items():
        assert loop_settings(name, 4, 2, {}).method == name  # a user's loop: validated as adloco train does
        config = build_config({"method": name, "sync_every": 6})
        assert _syncs_per_round(config.method, config.first_sync_every) == (6 if method.every_step else 1)
        common = {"sync_every", "method", "trainers", "outer", "codec", "sync_auto", "merge"}
        own = set(diloco_arguments(config, task.context)) - common
        assert own == set(method.sections) | ({"total_samples"} if method.adaptive_batch else set())
        # a replica hands DiLoCo the method's sections too, and its own
        assert set(diloco_arguments(config, task.context, replica=True)) == common | own | {"fault_tolerance"}
    with pytest.raises(ConfigError, match="method: 'hivemind' is not one of " + ", ".join(METHODS)):
        loop_settings("hivemind", 4, 2, {})


NAMES = set(METHODS)
# Where method names may be spelled out: the registry, and sync/ (which builds each strategy family).
OWNERS = ("config/methods.py", "sync/")


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = [_strings(e) for e in node.elts]
        return None if any(i is None for i in items) else [s for i in items for s in i or []]
    return None


def _knows_methods(node: ast.AST) -> bool:
    """A comparison of a ``method`` with a method name, or a list, set or dict of two or more method names."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Name) and s.id == "method" or getattr(s, "attr", None) == "method" for s in sides)
        return named and any(set(_strings(s) or ()) & NAMES for s in sides)
    if isinstance(node, ast.Dict):
        keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        return len(keys) >= 2 and set(keys) <= NAMES
    listed = _strings(node) if isinstance(node, ast.Tuple | ast.List | ast.Set) else None
    return listed is not None and len(listed) >= 2 and set(listed) <= NAMES


def test_no_module_outside_the_registry_and_sync_lists_methods_or_branches_on_their_names():
    package = Path(adloco.__file__).resolve().parent
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith(OWNERS):
            continue
        found += [f"{relative}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text())) if _knows_methods(n)]
    assert found == [], "ask the method object (adloco.config.methods) instead"


def test_the_name_check_finds_what_it_is_meant_to_find():
    """The check above would see a method list or a method-name branch (it is not vacuous)."""
    for source in ('if config.method == "ddp": pass', 'adaptive = method in ("adloco", "diloco")',
                   'METHODS = ["ddp", "localsgd"]', 'D = {"ddp": 1, "diloco": 2}'):  # fmt: skip
        assert any(_knows_methods(n) for n in ast.walk(ast.parse(source))), source
    for source in ('state = {"diloco", "model", "optimizer"} <= set(saved)', 'log = getLogger("adloco")'):
        assert not any(_knows_methods(n) for n in ast.walk(ast.parse(source))), source
