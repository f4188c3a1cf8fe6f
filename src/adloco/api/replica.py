"""A user's loop as one replica of a fault-tolerant job on torchft.

Each replica (a torchft replica group) hosts one worker: one process, or the ranks of a worker sharded over several
with FSDP2, each exchanging its rows with the ranks holding the same rows in the other replicas. At the start of
every round the replica asks torchft's Lighthouse for the round's quorum: the replicas there train the round
together and exchange over a process group the Manager reconfigures to them, without a restart. A replica that
starts (new, or again after it died) is held at that call until the running replicas end their round, then heals
from one of them: θ, the outer optimizer state and the round counters; its inner optimizer starts afresh. A replica
that dies mid-round is missing from the round's exchange: the exchange fails on the others, who drop that round (no
outer step; it is not redone) and form the next round's quorum without it, where its slot reads as absent (out). A
replica that committed less than its peers (an exchange that failed on it alone), or whose θ turns out unlike theirs
at an exchange (two quorums trained apart), heals at the next round.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from adloco.api.worker import WorkerShards
from adloco.comm.replicas import ReplicaCommunicator
from adloco.config.sections import FaultToleranceConfig

log = logging.getLogger("adloco")


@dataclass
class RoundFaults:
    """What one round's quorum and exchange were: who took part, who was missing, whether it committed."""

    round: int
    participants: int
    absent: list[int] = field(default_factory=list)
    committed: bool = True
    healed: bool = False  # this replica healed from a peer at the round's start
    diverged: bool = False  # its θ was unlike its peers' at the round's exchange: it heals at the next round
    quorum_seconds: float = 0.0
    sync_every: int = 0  # H of the round (sync_every=auto: the job's choice, the same on every replica)
    batch: dict[int, int] | None = None  # AdLoCo: each trainer's b_req decided at the round's end
    sync: dict[str, Any] | None = None  # the next round's H and why (``SyncDecision.to_dict``), as decided here
    started: float = 0.0  # wall-clock time (time.time()) the round's quorum formed


class Replica:
    """This process as replica ``settings.replica`` of ``settings.replicas``: its torchft Manager, the transport
    over the Manager's process group (``comm``), and the heal, through ``save`` and ``load`` of the loop's state."""

    def __init__(
        self,
        settings: FaultToleranceConfig,
        save: Callable[[], Any],
        load: Callable[[Any], None],
        current_round: Callable[[], int],
        device: torch.device,
        shards: WorkerShards | None = None,
    ) -> None:
        try:
            from torchft.manager import Manager
        except ImportError as error:
            raise ValueError(f"fault_tolerance needs torchft (pip install 'adloco[torchft]'): {error}") from None
        assert settings.lighthouse is not None and settings.replica is not None and settings.replicas is not None
        self.shards = shards
        if settings.min_replicas <= settings.replicas // 2:
            self._warn("fault_tolerance.min_replicas=%d is not a majority of %d replicas: the job can split into "
                        "quorums that train apart; a majority (Lighthouse --min-replicas too) rules that out",
                        settings.min_replicas, settings.replicas)  # fmt: skip
        backend = exchange_backend(settings.backend, device)
        host = settings.host or socket.gethostname()
        timeout = timedelta(seconds=settings.exchange_timeout_s)
        store_host, store_port = self._group_store(host)
        self._load, self._current_round = load, current_round
        self.healed = False
        self.manager = Manager(
            pg=_process_group(backend, timeout),
            load_state_dict=self._heal,
            state_dict=save,
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,  # a round's quorum (and heal) completes before its first inner step
            timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timeout,
            rank=0 if shards is None else shards.index,
            world_size=1 if shards is None else shards.count,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=settings.lighthouse,
            replica_id=f"adloco_{settings.replica:05d}",  # sorted by id: replica 0 is the first source of θ
            hostname=host,
            init_sync=True,  # at the start every replica takes θ from the same one
            quorum_retries=settings.quorum_retries,
        )
        # torchft warns at every quorum that a CPU job has no NCCL flight recorder to reset: nothing to act on
        logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())
        transport = device if backend == "nccl" else torch.device("cpu")
        self.comm = ReplicaCommunicator(self.manager, settings.replica, settings.replicas, transport)
        self.history: list[RoundFaults] = []

    def _group_store(self, host: str) -> tuple[str, int]:
        """The address of the replica group's own store, which its shard 0 holds (its peers reach it to form the
        quorum's process group); the other shards of a sharded worker, on that host or another, learn it over
        their shard group."""
        self.store = None
        if self.shards is None or self.shards.index == 0:
            self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if self.shards is None:
            return host, self.store.port
        address: list[Any] = [(host, self.store.port) if self.store is not None else None]
        first = torch.distributed.get_global_rank(self.shards.group, 0)
        torch.distributed.broadcast_object_list(address, src=first, group=self.shards.group)
        return address[0]

    def _heal(self, state: Any) -> None:
        self._load(state)
        self.healed = True

    def start_round(self) -> bool:
        """Join the next round's quorum; True when this replica healed from a peer there (its state replaced)."""
        self.healed = False
        start = time.perf_counter()
        self.comm.start_round()
        seconds = time.perf_counter() - start
        index = self._current_round()  # a peer's round after a heal
        record = RoundFaults(index, self.comm.participants, healed=self.healed, quorum_seconds=seconds)
        record.started = time.time()
        self.history.append(record)
        if self.healed and index > 0:
            self._warn("replica %d joined at round %d and healed from a peer", self.comm.rank, index + 1)
        return self.healed

    def end_round(self, sync: dict[str, Any] | None = None) -> None:
        """Note the round's exchange: the replicas absent from it, whether it committed, and the H decided after
        it (``sync``). A line is logged when the replicas taking part change, not every round."""
        if not self.history:
            return
        self.comm.end_round()
        record = self.history[-1]
        record.sync = sync
        record.absent = sorted(self.comm.missing)
        record.committed = self.comm.committed
        # every shard of a sharded worker heals, or none: torchft asks the Lighthouse with one step for them all
        diverged = self.comm.diverged
        record.diverged = diverged if self.shards is None else not self.shards.all_agree(not diverged)
        if record.diverged:
            self._heal_next_round(record.round)
        before = self.history[-2].absent if len(self.history) > 1 else []
        if not record.committed:
            self._warn("round %d was dropped: its exchange failed (no outer step)", record.round + 1)
        elif record.absent != before:
            present = self.comm.world_size - len(record.absent)
            missing = ", ".join(map(str, record.absent)) or "none"
            self._warn("round %d: %d of %d replicas took part (absent: %s)", record.round + 1, present,
                        self.comm.world_size, missing)  # fmt: skip

    def _heal_next_round(self, index: int) -> None:
        """This replica's θ is not its peers' (the job split into quorums that trained apart): it counts itself a
        step behind, so the next quorum heals it from a peer that is not (torchft heals the replicas behind)."""
        state = self.manager.state_dict()
        self.manager.load_state_dict({**state, "step": max(0, state["step"] - 1)})
        self._warn("replica %d: its θ after round %d is not its peers' (the job had split into quorums that trained "
                    "apart); it heals from a peer at the next round", self.comm.rank, index + 1)  # fmt: skip

    def _warn(self, message: str, *args: Any) -> None:
        """A line about the job, once per replica: from the first shard of a sharded worker."""
        if self.shards is None or self.shards.index == 0:
            log.warning(message, *args)

    def close(self) -> None:
        self.comm.close()


def exchange_backend(backend: str, device: torch.device) -> str:
    """The replicas' process group for a model on ``device``: NCCL for a GPU model unless gloo is asked for."""
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"fault_tolerance.backend=nccl needs the model on a CUDA device, not {device.type}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


def _process_group(backend: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable group of that backend."""
    if backend == "nccl":
        from torchft.process_group import ProcessGroupNCCL

        return ProcessGroupNCCL(timeout=timeout)
    from torchft.process_group import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timeout)
