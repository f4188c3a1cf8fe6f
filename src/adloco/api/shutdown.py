"""Ending a torchrun process cleanly once a loop (or a framework's trainer) is done."""

import gc

import torch.distributed as dist


def end_process_group() -> None:
    """Destroy the default process group (and every other) while Python is still fully alive.

    Call it after the function that trained has returned. Trainers (HF, Lightning, DDP wrappers, a DiLoCo
    object's optimizer hooks) sit in reference cycles that keep the process group alive; left to interpreter
    teardown, gloo's worker threads can meet a finalizing interpreter and abort the process (SIGABRT, "terminate
    called without an active exception") after all the work was done. Collecting those cycles first, then
    destroying the groups, joins the threads now.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
