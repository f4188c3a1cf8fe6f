"""Where the ranks of a user's loop compare their step counts at ``finish()``: through the process group's store.

Not in a collective: a rank that took more steps may sit inside an exchange the others never reach (its extra steps
ended a round), and a collective of ``finish()`` would meet that exchange's instead; unlike collectives do not pair,
and gloo hangs or aborts natively.

``finish()`` posts this rank's step count, and how many exchange collectives it started, under a key of the
process group's store and waits (bounded by the store's timeout) for every rank's word. A rank whose exchange takes
longer than a moment looks at the store now and then while it waits: a peer that finished without starting one of
the collectives this rank waits in will never join it, so this rank posts its own count and those collectives;
each finished rank joins them with zeros (and any other collective a peer started past its own count, such as a
streaming fragment's in flight: nothing is left pending, the group stays in step for whatever the loop does next),
and every rank refuses in one line naming the counts. An even run writes and reads a few keys once, at
``finish()``, and no collective; during training only an exchange that waits longer than a tenth of a second reads
one key of the store now and then.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from adloco.comm.distributed import DistributedCommunicator
from adloco.comm.launcher import restart_attempt

# A collective this rank started: its group (the workers' ids, joined), its number among the group's collectives,
# the operation, and the shape and dtype of this rank's tensor in it.
Op = tuple[str, int, str, list[int], str]

_FIRST_LOOK = 0.1  # seconds an exchange waits before it first looks at the store (an even run's rarely do)
_LAST_LOOK = 1.0  # the longest pause between looks: a rank ahead learns within a second that a peer finished
_MADE: dict[tuple[int, ...], int] = {}  # DiLoCo objects made over each group of ranks, in this process


def uneven_steps(counts: dict[int, int]) -> str:
    """The one line every rank refuses with when the ranks took different numbers of optimizer steps."""
    named = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
    return (
        f"the ranks took different numbers of optimizer steps ({named}): every rank must take as many (end an uneven "
        "epoch at the step all ranks reach; a GradScaler skips optimizer.step() on a rank that overflowed: call "
        "diloco.step() after scaler.step(optimizer), not `with diloco:`; docs/own-loop.md)"
    )


class WatchedCommunicator(DistributedCommunicator):
    """The exchange's transport in a user's loop: it numbers the collectives it starts on each group and keeps the
    ones not yet complete, and (with a ``line``) its waits look at the finish line now and then."""

    line: FinishLine | None = None
    issued: dict[str, int]  # collectives started on each group
    pending: dict[tuple[str, int], Op]  # those not complete yet

    @classmethod
    def on_group(
        cls, group: Any = None, reduce: str = "gather", device: torch.device | None = None
    ) -> WatchedCommunicator:
        view = super().on_group(group, reduce, device)
        assert isinstance(view, WatchedCommunicator)
        view.issued, view.pending = {}, {}
        return view

    def _all_gather(self, outputs: list[torch.Tensor], local: torch.Tensor, workers: Sequence[int]) -> Future:
        return self._counted("all_gather", local, workers, super()._all_gather(outputs, local, workers))

    def _all_reduce(self, flat: torch.Tensor, workers: Sequence[int]) -> Future:
        return self._counted("all_reduce", flat, workers, super()._all_reduce(flat, workers))

    def _counted(self, kind: str, tensor: torch.Tensor, workers: Sequence[int], future: Future) -> Future:
        key = ",".join(str(w) for w in sorted(workers))
        seq = self.issued.get(key, 0)
        self.issued[key] = seq + 1
        pending = self.pending
        pending[(key, seq)] = (key, seq, kind, list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        # runs on gloo's thread, which may drop the callback last: it holds the dict alone, never this object (and
        # through it a group handle whose destructor would join the thread it runs on)
        future.add_done_callback(lambda _: pending.pop((key, seq), None))
        return future

    def wait(self, future: Future) -> Any:
        """Block until ``future`` is done; past a moment, look at the finish line between pauses (an event wakes
        this wait the instant the future completes: the looks add no latency)."""
        line = self.line
        if line is None:
            return super().wait(future)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        start = time.perf_counter()
        pause = _FIRST_LOOK
        try:
            while not done.wait(pause):
                line.look(self)
                pause = min(2 * pause, _LAST_LOOK)
            return future.wait()
        finally:
            self.stats.wait_seconds += time.perf_counter() - start

    def join(self, ops: list[Op]) -> None:
        """Take part in ``ops`` (collectives other ranks started and this one never did: a rank ahead waits in
        them) with zeros, in order, so that none is left pending in the group."""
        futures = []
        for key, _, kind, shape, dtype in ops:
            workers = [int(w) for w in key.split(",")]
            zeros = torch.zeros(shape, dtype=getattr(torch, dtype), device=self.device)
            if kind == "all_gather":
                outputs = [torch.empty_like(zeros) for _ in self.ranks_of(workers)]
                futures.append(super()._all_gather(outputs, zeros, workers))  # not counted: not this rank's own
            else:
                futures.append(super()._all_reduce(zeros, workers))
        for future in futures:
            future.wait()  # bounded by the process group's timeout, as every collective


class FinishLine:
    """The store keys where the ranks of one DiLoCo object post their step counts at ``finish()``."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        # every rank makes its DiLoCo objects over a group in the same order (their construction is collective), so
        # the count names this object alike on every rank; the attempt keeps a restarted job's keys apart
        _MADE[ranks] = made = _MADE.get(ranks, -1) + 1
        self.prefix = f"adloco/finish/{restart_attempt()}/{'-'.join(map(str, ranks))}/{made}"
        self.store = dist.distributed_c10d._get_default_store()
        self.timeout: timedelta = self.store.timeout
        self.rank, self.world_size = rank, world_size
        self.steps = 0  # optimizer steps this rank has taken, the one in progress counted
        self.refusal: str | None = None

    def _key(self, name: int | str) -> str:
        return f"{self.prefix}/{name}"

    def arrive(self, comm: WatchedCommunicator, steps: int) -> None:
        """Post this rank's ``steps`` and wait for every rank's word: join the collectives other ranks started and
        this rank did not (a rank ahead waits in them, or has them in flight: a streaming fragment's, an overlapped
        exchange's), and refuse on any difference."""
        self._post(comm, steps, waiting=False)
        self.store.add(self._key("finished"), 1)
        keys = [self._key(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, self.timeout)
        except dist.DistStoreError:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            self._refuse(
                comm,
                f"rank(s) {', '.join(map(str, missing))} did not reach finish() within "
                f"{self.timeout.total_seconds():.0f} s (the process group's store's timeout; rank "
                f"{self.rank} took {steps} optimizer steps): every rank must take as many and call finish()",
            )
        words = {r: json.loads(value) for r, value in enumerate(self.store.multi_get(keys))}
        # a rank gone while this one joins its collectives changes nothing: the counts below differ, and say so
        with contextlib.suppress(RuntimeError):
            comm.join(_missed(list(words.values()), comm.issued, self.rank))
        if any(word["waiting"] for word in words.values()) or len({word["steps"] for word in words.values()}) > 1:
            self._refuse(comm, uneven_steps({r: word["steps"] for r, word in words.items()}))

    def look(self, comm: WatchedCommunicator) -> None:
        """While an exchange waits: refuse if a rank finished without starting a collective this rank waits in
        (it never will); first post this rank's count and those collectives, and wait until the finished ranks
        joined them."""
        if not int(self.store.add(self._key("finished"), 0)):
            return
        words = self._words()
        stuck = sorted(
            op
            for op in list(comm.pending.values())
            if any(word["issued"].get(op[0], 0) <= op[1] for r, word in words.items() if str(r) in op[0].split(","))
        )
        if not stuck:
            return
        self._post(comm, self.steps, waiting=True)
        waited = time.monotonic()
        while any(op[:2] in comm.pending for op in stuck) and time.monotonic() - waited < self.timeout.total_seconds():
            time.sleep(0.01)
        self._refuse(comm, uneven_steps({**{r: w["steps"] for r, w in self._words().items()}, self.rank: self.steps}))

    def _post(self, comm: WatchedCommunicator, steps: int, waiting: bool) -> None:
        """This rank's word: its steps, the collectives it started on each group and those not complete yet, and
        whether it waits in an exchange (rather than at finish())."""
        pending = sorted(comm.pending.values())
        word = {"steps": steps, "issued": comm.issued, "pending": pending, "waiting": waiting}
        self.store.set(self._key(self.rank), json.dumps(word))

    def _words(self) -> dict[int, dict[str, Any]]:
        """What the ranks posted so far."""
        keys = {r: self._key(r) for r in range(self.world_size)}
        return {r: json.loads(self.store.get(key)) for r, key in keys.items() if self.store.check([key])}

    def _refuse(self, comm: WatchedCommunicator, message: str) -> None:
        self.refusal = message
        comm.line = None
        # as at a finish() that succeeds: no gloo thread may be left to release the group
        comm.close()
        raise RuntimeError(message)


def _missed(words: list[dict[str, Any]], issued: dict[str, int], rank: int) -> list[Op]:
    """The collectives other ranks have pending that this rank never started, on its groups, in their order."""
    ops = {(op[0], op[1]): op for word in words for op in word["pending"]}
    mine = [op for key, op in ops.items() if str(rank) in key[0].split(",") and key[1] >= issued.get(key[0], 0)]
    return sorted(mine, key=lambda op: (op[0], op[1]))
