"""Round reports: exact packing, and their ride inside a payload of another dtype."""

import math

import pytest
import torch

from adloco.algorithms.batch_tests import GradientStatistics
from adloco.comm.base import pack_report, unpack_report
from adloco.sync.ddp import DDPSync
from adloco.workers.reports import BoundaryRequest, RoundState, StepRecord, WorkerRound, joined


def _report():
    steps = [StepRecord(loss=2.0 / 3.0, tokens=768, finite=True), StepRecord(loss=math.nan, tokens=0, finite=False)]
    stats = GradientStatistics(samples=6, grad_norm_sq=1e-9 / 7, sample_variance=3.25, ip_variance=None)
    return WorkerRound(steps=steps, statistics=stats, b_max=12, out=True, request=BoundaryRequest(15, True))


def test_a_round_report_survives_packing_bit_for_bit():
    report = WorkerRound.from_tensor(_report().to_tensor())
    assert report.out and report.failed and report.b_max == 12
    assert report.request == BoundaryRequest(stop_signal=15, checkpoint=True)
    assert report.steps[0] == StepRecord(loss=2.0 / 3.0, tokens=768, finite=True)
    assert math.isnan(report.steps[1].loss) and report.steps[1].tokens == 0 and not report.steps[1].finite
    assert report.statistics == GradientStatistics(6, 1e-9 / 7, 3.25, None, None)
    assert WorkerRound.from_tensor(WorkerRound(b_max=3).to_tensor()).statistics is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_a_report_rides_in_a_payload_of_any_dtype_unchanged(dtype):
    packed = _report().to_tensor()
    row = torch.cat([torch.zeros(5, dtype=dtype), pack_report(packed, dtype)])  # as a gather row holds it
    back = unpack_report(row[5:])
    assert torch.equal(back.view(torch.int64), packed.view(torch.int64))  # NaN payloads included


def test_a_damaged_report_is_refused():
    with pytest.raises(ValueError, match="report"):
        WorkerRound.from_tensor(torch.zeros(8, dtype=torch.float64))


def test_requests_join_to_the_same_answer_on_every_rank():
    assert joined([]) == BoundaryRequest()
    assert joined([BoundaryRequest(), BoundaryRequest(checkpoint=True)]) == BoundaryRequest(0, True)
    # two ranks signalled differently name the same signal, whichever order their reports arrive in
    assert joined([BoundaryRequest(10), BoundaryRequest(15)]) == joined([BoundaryRequest(15), BoundaryRequest(10)])
    assert joined([BoundaryRequest(10), BoundaryRequest(15)]).stop_signal == 15


def test_a_request_stamped_at_any_step_reaches_the_boundary():
    """DDP sends one report per inner step: a request on any of them survives the round's merge."""
    state = RoundState(index=0, steps=3, first_step=0, statistics_due=False, local={0: WorkerRound(), 1: WorkerRound()})
    merged = WorkerRound()
    for step, request in enumerate([BoundaryRequest(), BoundaryRequest(10), BoundaryRequest(checkpoint=True)]):
        state.stamp(request)
        state.local[0].steps.append(StepRecord(loss=1.0, tokens=1, finite=True))
        merged.merge_step(WorkerRound.from_tensor(DDPSync._step_report(state, 0, step).to_tensor()))
    assert merged.request == BoundaryRequest(stop_signal=10, checkpoint=True)
    state.reports = {0: merged, 1: WorkerRound()}
    assert state.boundary_request() == BoundaryRequest(stop_signal=10, checkpoint=True)
