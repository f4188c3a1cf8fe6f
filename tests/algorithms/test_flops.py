"""Model FLOPs per token and MFU (PaLM's accounting)."""

import pytest

from adloco.algorithms.flops import flops_per_token, utilisation


def test_six_n_plus_attention():
    assert flops_per_token(1_000, 2, 8, 16) == 6 * 1_000 + 12 * 2 * 8 * 16
    with pytest.raises(ValueError):
        flops_per_token(-1, 2, 8, 16)


def test_utilisation_is_the_share_of_the_peak():
    assert utilisation(1_000.0, 6e9, 1e13) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        utilisation(1.0, 1.0, 0.0)
