"""Model FLOPs per trained token, and utilisation against a device's peak (MFU).

The count is PaLM's (arXiv 2204.02311, appendix B): 6N for the forward and backward matrix products of N
parameters, plus 12·L·d·T for attention's score and value products over a context of T tokens, with N the
parameters outside the input embedding (a lookup, no product; the output head is a product and counts). MFU
counts the model's FLOPs only: recomputation, padding and the outer step's arithmetic are not useful work.
"""

from __future__ import annotations


def flops_per_token(parameters: int, layers: int, hidden: int, context: int) -> float:
    """Training FLOPs per token of a decoder with ``parameters`` outside the input embedding."""
    if min(parameters, layers, hidden, context) < 0:
        raise ValueError("a model's sizes are not negative")
    return 6.0 * parameters + 12.0 * layers * hidden * context


def utilisation(tokens_per_second: float, per_token: float, peak_flops: float) -> float:
    """The share of ``peak_flops`` (FLOP/s) that ``tokens_per_second`` tokens of ``per_token`` FLOPs use."""
    if peak_flops <= 0:
        raise ValueError(f"a peak of {peak_flops} FLOP/s")
    return tokens_per_second * per_token / peak_flops
