"""sync_every=auto in adloco train: H chosen at each boundary, recorded with its reasons, bounded, on progress."""

import pytest

from adloco import build_config, train
from adloco.cluster.batches import auto_sync_every
from adloco.config import ConfigError
from adloco.metrics.records import read_metrics
from tests.conftest import PINNED_PACE


def _rounds(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]


@pytest.mark.training
def test_auto_follows_the_pinned_costs_within_its_bounds_and_says_why(fast_overrides):
    bounds = ["sync_every=auto", "sync_auto.min=2", "sync_auto.max=8", "sync_auto.start=2", "total_tokens=2048"]
    slow = train(build_config(overrides=[*fast_overrides, *bounds, *PINNED_PACE]))
    rounds = _rounds(slow.run_dir)
    # t = 2 workers x (0.01 + 0.001 x 2) s, c = 0.05 s: H* = sqrt(400 x 0.05 / 0.024) = 29, beyond the bound; the
    # first decision on measured costs goes straight there
    assert [r["sync_every"] for r in rounds][:4] == [2, 8, 8, 8]
    assert [r["sync"]["reason"] for r in rounds][:3] == ["max", "max", "max"]
    first = rounds[0]["sync"]
    assert 400 <= first["drift_steps"] < 440  # the lr has begun to decay: H_d grows
    assert first["target"] == pytest.approx((first["drift_steps"] * 0.05 / 0.024) ** 0.5)
    assert first["exposed_fraction"] == pytest.approx(0.05 / (0.05 + 2 * 0.024))
    assert all(r["sync"]["dispersion"] is not None and r["sync"]["dispersion"] >= 0 for r in rounds)
    assert rounds[-1]["tokens"] == 2048
    steep = train(build_config(overrides=[*fast_overrides, *bounds, *PINNED_PACE, "sync_auto.lr_power=2"]))
    steep_first = _rounds(steep.run_dir)[0]["sync"]  # the same lr: H_d = 400 (peak/lr)^2 where it was 400 peak/lr
    assert first["drift_steps"] > 400  # else the squares below would agree for any power
    assert steep_first["drift_steps"] == pytest.approx(first["drift_steps"] ** 2 / 400)
    flat = [*fast_overrides, *bounds, *PINNED_PACE, "sync_auto.lr_stretch=1"]  # the lr phase off: H_d as M sets it
    four = train(build_config(overrides=[*flat, "workers=4"]))
    assert {r["sync"]["drift_steps"] for r in _rounds(four.run_dir)} == {200}  # half the 2 workers' 400
    # a cheap round: H falls to its lower bound
    cheap = [*PINNED_PACE[:1], "batch.time.round_seconds=0.00001", *PINNED_PACE[2:]]
    fast = train(build_config(overrides=[*fast_overrides, *bounds, "sync_auto.start=8", *cheap]))
    assert [r["sync_every"] for r in _rounds(fast.run_dir)][:4] == [8, 2, 2, 2]


def test_the_drift_scale_is_that_of_two_workers_and_falls_with_more():
    def drift(*overrides):
        config = build_config(overrides=["sync_every=auto", *overrides])
        return auto_sync_every(config.sync_every, config.sync_auto, config.streaming, config.workers).drift_steps

    assert drift("workers=2", "sync_auto.workers_power=1") == drift("workers=2", "sync_auto.workers_power=0") == 400
    assert drift("workers=4", "sync_auto.workers_power=1", "sync_auto.drift_steps=300") == 150
    assert drift("workers=4", "sync_auto.workers_power=0") == 400
    assert drift("workers=4") == 200  # the default: halved at twice the workers
    assert drift("method=adloco", "trainers=3", "workers=1", "sync_auto.workers_power=1") == 800  # M per trainer


def test_a_fixed_h_records_its_exposed_fraction_and_dispersion(fast_overrides):
    rounds = _rounds(train(build_config(overrides=[*fast_overrides, "total_tokens=512"])).run_dir)
    assert all(r["sync_every"] == 4 and r["sync"]["reason"] == "fixed" for r in rounds)
    measured = [r["sync"] for r in rounds[1:]]  # the first round has no previous overhead to report
    assert all(0 < s["exposed_fraction"] < 1 and s["dispersion"] >= 0 for s in measured)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method=ddp", "sync_every=auto"], "ddp averages gradients every step"),
        (["sync_every=fast"], "'fast' is neither a number of inner steps nor auto"),
        (["sync_every=auto", "batch.time.keep_round_time=true"], "already chooses the round's length"),
        (["sync_every=auto", "sync_auto.min=9", "sync_auto.max=8"], "larger than sync_auto.max"),
        (["sync_every=auto", "sync_auto.lr_power=5"], "sync_auto.lr_power"),
        (["method=streaming", "sync_every=auto", "sync_auto.min=2", "streaming.overlap=1"], "overlap"),
    ],
)
def test_settings_auto_cannot_honour_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=overrides)


def test_streaming_bounds_become_multiples_of_the_fragments():
    config = build_config(overrides=["method=streaming", "sync_every=auto", "streaming.fragments=4"])
    assert config.sync_bounds == (8, 200) and config.first_sync_every == 12
