"""A framework replica's data after a heal: skipped by index, nothing loaded; refused with a warning where it
cannot be (an iterable dataset)."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from adloco.integrations.replicas import data_position, skip_batches, steps_per_epoch


class Counted(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


def test_a_loader_skips_its_first_batches_by_index_in_every_pass_until_one_is_trained():
    dataset = Counted()
    loader = DataLoader(dataset, batch_size=2)
    skipped = skip_batches(loader, 3, "test")
    assert [b.tolist() for b in loader] == [[6, 7], [8, 9]]
    assert dataset.loaded == [6, 7, 8, 9]  # the skipped batches' samples were never loaded
    assert len(loader) == 5 and [b.tolist() for b in loader] == [[6, 7], [8, 9]]  # a pass begun again skips too
    skipped.batches = 0
    assert [b.tolist() for b in loader][0] == [0, 1]


def test_a_position_counts_the_short_last_step_of_an_epoch():
    per_epoch = steps_per_epoch(batches=7, accumulation=2)  # 2+2+2+1
    assert per_epoch == 4
    assert data_position(9, per_epoch, accumulation=2) == (2, 2)


def test_an_iterable_dataset_cannot_skip_and_says_so():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match="reads its data from the start"):
        assert skip_batches(loader, 3, "Trainer") is None
    assert next(iter(loader)).tolist() == [0, 1]


def _trainer_args(tmp_path, accumulation: int):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=accumulation, max_steps=100,
                             use_cpu=True, report_to=[])  # fmt: skip


def test_a_trainers_data_moves_to_the_jobs_epoch_and_batch(tmp_path):
    from adloco.integrations.hf import _DataMoved

    loader = DataLoader(Counted(), batch_size=2)  # 5 batches: 5 steps an epoch
    moved = _DataMoved.to_step(loader, began=0, step=12, args=_trainer_args(tmp_path, 1))
    assert moved.shift == 2 and moved.epochs_ahead == pytest.approx(2.4)  # epoch 2, 2 of its 5 batches read
    assert [b.tolist() for b in loader][0] == [4, 5]


def test_a_trainer_that_cannot_close_a_short_accumulation_step_enters_the_jobs_epoch_at_its_start(tmp_path):
    from adloco.integrations.hf import _DataMoved

    loader = DataLoader(Counted(), batch_size=2)  # 5 batches, 2 a step: 3 steps an epoch, the last of one batch
    with pytest.warns(UserWarning, match="short last step"):
        moved = _DataMoved.to_step(loader, began=0, step=4, args=_trainer_args(tmp_path, 2))
    assert moved.shift == 1 and moved.skipped.batches == 0
    assert [b.tolist() for b in loader][0] == [0, 1]


def test_before_transformers_5_a_resumed_trainer_reads_on_from_its_checkpoint(tmp_path, monkeypatch):
    from transformers import Trainer

    from adloco.integrations.hf import _DataMoved

    monkeypatch.delattr(Trainer, "_run_epoch")  # the epoch loop of transformers 5, which reads ignore_data_skip late
    loader = DataLoader(Counted(), batch_size=2)
    args = _trainer_args(tmp_path, 1)
    with pytest.warns(UserWarning, match="before transformers 5"):
        assert _DataMoved.to_step(loader, began=4, step=12, args=args) is None
    assert not args.ignore_data_skip and [b.tolist() for b in loader][0] == [0, 1]
