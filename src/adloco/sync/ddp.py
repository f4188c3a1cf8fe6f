"""DDP: the gradients are averaged after every backward; workers stay identical, so there is no outer step."""

from __future__ import annotations

import torch

from adloco.sync.base import SyncStrategy
from adloco.workers.reports import RoundState, WorkerRound


class DDPSync(SyncStrategy):
    """One exchange per inner step: the mean gradient over the step's healthy workers, with every worker's
    step report (loss, tokens, health) in the same collective. A worker whose step was not finite is left
    out of that step's mean only; a trainer whose workers all failed skips the step."""

    def after_backward(self, state: RoundState, step: int) -> set[int]:
        stepping: set[int] = set()
        for trainer in self.taking_part():
            hosted = self.hosted(trainer)
            now = {w: self._step_report(state, w, step) for w in hosted}
            grads = {
                w: [torch.zeros_like(p) for p in self.workers[w].params]
                if not now[w].steps[0].finite
                else self.workers[w].gradients()
                for w in hosted
            }
            packed = {w: r.to_tensor() for w, r in now.items()}
            gathered = self.comm.wait(self.comm.sum_with_reports(grads, packed, trainer.worker_ids))
            assert gathered.total is not None
            healthy = 0
            for w, tensor in gathered.reports.items():
                report = WorkerRound.from_tensor(tensor)
                state.reports.setdefault(w, WorkerRound()).merge_step(report)
                healthy += report.steps[0].finite
            if healthy == 0:
                state.skipped.add(trainer.trainer_id)
                continue
            mean = [t.div_(healthy) for t in gathered.total]
            for w in hosted:
                self.workers[w].set_gradients(mean)
            stepping.update(hosted)
        return stepping

    @staticmethod
    def _step_report(state: RoundState, worker_id: int, step: int) -> WorkerRound:
        local = state.local[worker_id]
        return WorkerRound(
            steps=[local.steps[step]],
            statistics=local.statistics if step == 0 else None,
            b_max=local.b_max,
            request=local.request,
        )

    def end_of_round(self, state: RoundState) -> None:
        for trainer in self.taking_part():
            trainer.adopt_worker_params(self.workers)
