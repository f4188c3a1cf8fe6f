"""The inner lr's coupling to a trainer's batch size."""

import math

import pytest

from adloco.algorithms.schedules import BatchCoupling


def test_batch_coupling_scales_lr_within_its_cap_and_keeps_beta2_memory_in_samples():
    coupling = BatchCoupling(b_start=4, lr_exponent=0.5, lr_cap=4.0, scale_beta2=True)
    assert coupling.lr_scale(4) == 1.0 and coupling.beta2(0.99, 4) == 0.99
    assert coupling.lr_scale(16) == 2.0
    assert coupling.lr_scale(1024) == 4.0  # sqrt(256) = 16, capped
    assert coupling.lr_scale(1) == 0.5  # a shrinking batch lowers the lr
    assert BatchCoupling(b_start=64, lr_exponent=1.0, lr_cap=4.0).lr_scale(1) == 0.25  # at least 1 / cap
    # β2' = β2^(b'/b): 1 - β2 is the share of a step in the average, so the half-life in samples is kept
    half_life = {b: b * math.log(0.5) / math.log(coupling.beta2(0.99, b)) for b in (4, 8, 32)}
    assert half_life[8] == pytest.approx(half_life[4]) and half_life[32] == pytest.approx(half_life[4])
    assert BatchCoupling(b_start=4).lr_scale(64) == 1.0 and BatchCoupling(b_start=4).beta2(0.99, 64) == 0.99
