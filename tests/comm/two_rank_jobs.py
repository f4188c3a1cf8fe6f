"""Several ``adloco train`` jobs, one after another, in one launch of two torchrun ranks.

Run by tests/comm/test_distributed.py: ``python -m torch.distributed.run --nproc_per_node=2 ... two_rank_jobs.py
JOBS.json``, where JOBS.json maps a job's name to its command-line items. Starting torchrun and two ranks costs
more than most of these jobs train, so the jobs that compare a two-rank run with one process share a launch. The
process group is made first, as a program that owns it does; each job is the command line's ``train`` on it, and
leaves the group to the program (the barrier after a job would fail on a group the job had ended).
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from adloco import end_process_group
from adloco.cli import main
from adloco.comm.distributed import start_process_group


def run_jobs(jobs: dict[str, list[str]]) -> None:
    start_process_group("gloo", timeout_s=120)
    for name, items in jobs.items():
        code = main(["train", *items])
        if code != 0:
            sys.exit(f"job {name}: adloco train ended with exit code {code}")
        dist.barrier()  # the next job starts on both ranks after this one ended on both
    end_process_group()


if __name__ == "__main__":
    run_jobs(json.loads(Path(sys.argv[1]).read_text()))
