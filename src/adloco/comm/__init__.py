"""Transport: how workers' tensors and scalars are combined, and what that costs on the wire."""

from adloco.comm.base import CommStats, Communicator
from adloco.comm.local import LocalCommunicator

__all__ = ["CommStats", "Communicator", "LocalCommunicator"]
