"""Test-only launcher: ``python -m tests.comm.crash_launch train ...`` runs adloco's CLI with one rank that dies
by SIGKILL, as a crashed node would, right after its N-th optimizer step, in the first attempt of a torchrun job.

The crash lives here, not in the package: ``CRASH_AFTER_STEP`` names N and ``CRASH_RANK`` the rank (default 0).
"""

import os
import signal
import sys

from adloco.cli import main
from adloco.comm.distributed import restart_attempt
from adloco.workers.worker import Worker

CRASH_AFTER_STEP, CRASH_RANK = "ADLOCO_TEST_CRASH_AFTER_STEP", "ADLOCO_TEST_CRASH_RANK"


def _arm() -> None:
    after = os.environ.get(CRASH_AFTER_STEP)
    if after is None or restart_attempt() > 0 or os.environ.get("RANK", "0") != os.environ.get(CRASH_RANK, "0"):
        return
    original, steps = Worker.step, [0]

    def step(self, lr):
        norm = original(self, lr)
        steps[0] += 1
        if steps[0] == int(after):
            os.kill(os.getpid(), signal.SIGKILL)
        return norm

    Worker.step = step


if __name__ == "__main__":
    _arm()
    sys.exit(main())
