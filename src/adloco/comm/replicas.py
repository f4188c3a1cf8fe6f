"""Transport among fault-tolerant replicas: one worker per replica, over a torchft ``Manager``'s process group.

The replicas present in a round are the round's quorum (torchft's Lighthouse forms it); the Manager reconfigures
its process group to them without a restart. Every exchange is one all-gather over that group: each replica sends
its own slot (a presence byte, its worker id and its row's bytes), and every replica lays the slots it receives
into a byte buffer with a slot per worker id, so it holds every present worker's row, bit for bit, in worker-id
order whatever the quorum's ranks are. A slot nobody sent is a worker absent from the round. (Where the Manager's
group offers no all-gather, each replica instead all-reduces the whole buffer with zeros outside its own slot:
the same bits, twice the bytes a replica sends.) The round's outer step is
committed only when every replica of the quorum finished the exchange (``Manager.should_commit``); a failed one
reads as every worker absent, so no outer step is taken from it anywhere.

With several trainers every replica takes every trainer's outer steps itself, from the rows: a trainer's exchange
travels in the exchange of the same place in the round of each replica's own trainer (the trainers share H,
fragments and codec, so each replica makes the same exchanges in the same order), whose slots hold every worker's
row, whichever trainer it belongs to. A replica's own trainer exchanges first; the others' then read the slots of
the exchange at their place, with no collective of their own (``holds_every_trainer``).

Each slot also carries a digest of the sender's θ (``theta_digest``), which is the same on every replica of a
healthy job. A replica whose θ differs from that of the lowest present worker (the job split: two quorums trained
apart, as a restarted Lighthouse can form them) marks itself ``diverged``; it then heals from a peer at the next
round's start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.futures import Future

from adloco.comm.base import CommStats, ExchangeMixin, OneProcessOps, contributed_bytes


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_slot(row: Sequence[torch.Tensor], slot: int, slots: int, device: torch.device | None = None) -> torch.Tensor:
    """A buffer on ``device`` (default: the CPU) of ``slots`` slots of (presence byte, the row's bytes) with
    ``row`` in slot ``slot``; the row's tensors may live anywhere."""
    device = device or torch.device("cpu")
    present = torch.ones(1, dtype=torch.uint8, device=device)
    payload = torch.cat([present, *[_bytes_of(t).to(device) for t in row]])
    buffer = torch.zeros(slots, payload.numel(), dtype=torch.uint8, device=device)
    buffer[slot] = payload
    return buffer


def place_slots(sent: Sequence[torch.Tensor], slots: int) -> torch.Tensor:
    """The buffer ``pack_slot`` lays out, from the slots an all-gather brought (each: presence byte, the sender's
    slot index as 4 bytes, its row's bytes); a slot nobody sent stays zero (absent)."""
    size = sent[0].numel() - 4
    buffer = torch.zeros(slots, size, dtype=torch.uint8, device=sent[0].device)
    headers = torch.stack([slot[:5] for slot in sent]).cpu()  # one copy off a GPU, not one sync per slot
    for slot, header in zip(sent, headers, strict=True):
        if header[0] == 1:
            index = int(header[1:5].clone().view(torch.int32)[0])
            buffer[index, 0] = 1
            buffer[index, 1:] = slot[5:]
    return buffer


def _zeros_like(row: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """An absent worker's row, on the CPU as the rows of an exchange come back (over torchrun too)."""
    return [torch.zeros(t.shape, dtype=t.dtype) for t in row]


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def unpack_slots(buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[list[torch.Tensor] | None]:
    """Each slot's row as CPU tensors shaped and typed as ``like``; None for a slot nobody wrote."""
    rows: list[list[torch.Tensor] | None] = []
    for slot in buffer.cpu():  # one copy off a GPU, then host slicing
        if slot[0].item() == 0:
            rows.append(None)
            continue
        offset, row = 1, []
        for t in like:
            size = t.numel() * t.element_size()
            # a fresh buffer: a slice may start at an offset the dtype's alignment does not allow
            row.append(slot[offset : offset + size].clone().view(t.dtype).reshape(t.shape))
            offset += size
        rows.append(row)
    return rows


class ReplicaCommunicator(OneProcessOps, ExchangeMixin):
    """Collectives among the replicas of a torchft job: worker ``rank`` is replica ``rank`` of ``world_size``.

    ``start_round`` asks the Lighthouse for the round's quorum (a joining replica heals there, in the Manager's
    ``load_state_dict`` callback); ``gather_over_workers`` is the round's exchange and commit. ``absent`` holds
    the workers missing from the last exchange (all of them when its commit failed), ``missing`` those of every
    trainer.
    """

    shards, shard = 1, 0  # a replica is one process
    holds_every_trainer = True  # every trainer's state is on every replica: none is mirrored from a lead rank

    def __init__(self, manager: Any, replica: int, replicas: int, device: torch.device | None = None) -> None:
        self.manager = manager
        self.device = device or torch.device("cpu")  # where the exchange's buffers live: the GPU for NCCL
        self.rank, self.world_size = replica, replicas
        self.stats = CommStats()
        self.absent: frozenset[int] = frozenset()  # of the workers the last exchange was asked for
        self.missing: frozenset[int] = frozenset()  # every worker missing from the last collective (all trainers')
        self.committed = False  # whether the last exchange committed
        self.theta_digest: Callable[[], int] | None = None  # the θ this replica holds, as a number (bits_digest)
        self.diverged = False  # an exchange of this round found this θ unlike the lowest present worker's
        # this round's exchanges of this replica's own trainer (every slot, as received; None: failed), and how
        # many of them each other trainer (by its workers) has read
        self._exchanged: list[list[list[torch.Tensor] | None] | None] = []
        self._read: dict[tuple[int, ...], int] = {}
        self._like: list[torch.Tensor] = []  # the rows' tensors (every trainer's alike)
        self.keeps_slots = False  # several trainers: the others read the own exchanges' slots (until the round ends)
        self._gathers = True  # whether the Manager's group all-gathers (else the slots are all-reduced)

    def start_round(self) -> None:
        """The round's quorum: blocks until the Lighthouse forms it (at most the quorum timeout)."""
        self.diverged = False
        self.end_round()
        self.manager.start_quorum()

    def end_round(self) -> None:
        """Let go of the round's slots (every replica's rows): the other trainers have read them."""
        self._exchanged, self._read = [], {}

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def _exchange_slots(self, row: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Every present replica's ``row`` in its slot of a buffer (``pack_slot``'s layout); None when the exchange
        failed (a replica died in it)."""
        group = getattr(self.manager, "_pg", None)  # the Manager's reconfigurable group (torchft 0.2)
        start = time.perf_counter()
        gathers = self._gathers and group is not None
        if gathers:
            try:
                buffer = self._all_gather(group, row)
            except NotImplementedError:  # a group without an all-gather (torchft's base class): all-reduce from now on
                self._gathers = gathers = False
        if not gathers:
            buffer = self._all_reduce(pack_slot(row, self.rank, self.world_size, self.device))
        self.stats.seconds += time.perf_counter() - start
        return buffer if self.manager.errored() is None else None

    def _all_gather(self, group: Any, row: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Each replica sends its own slot. The wait is on this thread, as the Manager's own all-reduce waits (no
        callback of ours runs on the group's threads); a failure is reported to the Manager, so the exchange reads
        as absent everywhere and the round does not commit."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if self.manager.errored() is not None:
            return None
        self.manager.wait_quorum()
        index = torch.tensor([self.rank], dtype=torch.int32).view(torch.uint8).to(self.device)
        payload = pack_slot(row, 0, 1, self.device)[0]
        sent = torch.cat([payload[:1], index, payload[1:]])
        if not self.manager.is_participating():
            sent.zero_()  # a replica that takes no part sends an absent slot
        try:
            received = [torch.empty_like(sent) for _ in range(group.size())]
            work = group.allgather([received], [sent], AllgatherOptions())
            self.stats.wire_bytes += sent.numel()
            work.wait()  # bounded by the group's timeout (the exchange timeout)
        except NotImplementedError:
            raise
        except Exception as error:  # a replica gone mid-exchange: the round is dropped, as torchft's own ops do
            self.manager.report_error(error)
            return None
        return place_slots(received, self.world_size)

    def _all_reduce(self, buffer: torch.Tensor) -> torch.Tensor:
        """Sum ``buffer`` (this replica's row in its slot, zeros elsewhere) over the quorum in place."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
        self.stats.wire_bytes += buffer.numel()
        return buffer

    def _committed_exchange(self, own: list[torch.Tensor]) -> torch.Tensor | None:
        """The slots of the exchange; None when it failed or did not commit. A failed exchange is never redone: its
        round is dropped, so every quorum the replicas ask for is a round's own, where a replica that fell behind (or
        joins, or committed less) heals. A redo in a quorum of its own let a joining replica make up the
        Lighthouse's count for a quorum it was then left out of, locking a survivor out (fault-tolerance.md)."""
        buffer = self._exchange_slots(own)
        return buffer if self.manager.should_commit() and buffer is not None else None

    def gather_over_workers(
        self, contributions: Mapping[int, Sequence[torch.Tensor]], workers: Sequence[int]
    ) -> Future[list[list[torch.Tensor]]]:
        """Every present worker's row in worker-id order (zeros for an absent one), and the round committed. Another
        trainer's workers (``contributions`` empty) read the slots of this replica's own exchange at their place."""
        if not contributions:
            return self._read_slots(workers)
        if set(contributions) != {self.rank}:
            raise RuntimeError(f"replica {self.rank} hosts worker {self.rank} alone, not {sorted(contributions)}")
        own = list(contributions[self.rank])
        digest = torch.tensor([self.theta_digest() if self.theta_digest is not None else 0], dtype=torch.int64)
        start = time.perf_counter()
        buffer = self._committed_exchange([*own, digest])
        self.stats.wait_seconds += time.perf_counter() - start
        slots = unpack_slots(buffer, [*own, digest]) if buffer is not None else None
        if slots is not None:
            self._check_digests([slot[-1] for slot in slots if slot is not None], digest)
        rows = None if slots is None else [slot[:-1] if slot is not None else None for slot in slots]
        if self.keeps_slots:
            self._exchanged.append(rows)
        self._like = own
        self.missing = frozenset(w for w, slot in enumerate(slots or [None] * self.world_size) if slot is None)
        present = self._rows_of(rows, workers)
        self.stats.bytes_sent += contributed_bytes([own] * (len(workers) - len(self.absent)), workers)
        self.stats.exchanges += 1
        return _done(present)

    def _read_slots(self, workers: Sequence[int]) -> Future[list[list[torch.Tensor]]]:
        """Another trainer's exchange: the slots of this replica's own exchange at the same place in the round."""
        key = tuple(sorted(workers))
        place = self._read.get(key, 0)
        if place >= len(self._exchanged):
            raise RuntimeError(f"replica {self.rank}: the trainer of workers {list(key)} exchanged before this "
                               "replica's own trainer, or more often")  # fmt: skip
        self._read[key] = place + 1
        rows = self._rows_of(self._exchanged[place], workers)
        self.stats.bytes_sent += contributed_bytes([self._like] * (len(workers) - len(self.absent)), workers)
        return _done(rows)

    def _rows_of(self, slots: list[list[torch.Tensor] | None] | None, workers: Sequence[int]) -> list:
        """``workers``' rows from an exchange's slots (None: it failed), zeros for the absent; notes who was absent
        and whether it committed."""
        self.committed = slots is not None
        rows = slots if slots is not None else [None] * self.world_size
        self.absent = frozenset(w for w in workers if rows[w] is None)
        return [rows[w] if rows[w] is not None else _zeros_like(self._like) for w in sorted(workers)]

    def _check_digests(self, present: list[torch.Tensor], own: torch.Tensor) -> None:
        """Whether this replica's θ is unlike the lowest present worker's (theirs are in worker-id order)."""
        if self.theta_digest is not None and present and not torch.equal(present[0], own):
            self.diverged = True

    def absent_from_last(self) -> frozenset[int]:
        return self.absent

    def gather_worker_scalars(
        self, contributions: Mapping[int, Sequence[float]], workers: Sequence[int] | None = None
    ) -> dict[int, list[float]]:
        """Every present worker's floats, in the round's quorum (no commit of its own)."""
        own = torch.tensor(list(contributions[self.rank]), dtype=torch.float64)
        buffer = self._exchange_slots([own])
        if buffer is None:
            return {self.rank: own.tolist()}
        rows = unpack_slots(buffer, [own])
        return {w: row[0].tolist() for w, row in enumerate(rows) if row is not None}

    def ranks_of(self, workers: Sequence[int]) -> list[int]:
        return sorted(workers)

    def close(self) -> None:
        self.manager.shutdown(wait=False)
