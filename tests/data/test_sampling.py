"""The window order of token files: a keyed bijection, and cursors whose whole state is a counter."""

import time

import numpy as np
import pytest

from adloco.data.sampling import WindowCursor, WindowOrder, cursor_end, regrouped
from adloco.errors import DataError


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_order_of_an_epoch_is_a_permutation(n):
    order = WindowOrder(n, seed=7)
    for epoch in (0, 1, 5):
        drawn = order(epoch, np.arange(n))
        assert sorted(drawn.tolist()) == list(range(n))


def test_the_order_depends_on_seed_and_epoch_and_on_nothing_else():
    n = 10_000
    base = WindowOrder(n, seed=3)(0, np.arange(n))
    assert np.array_equal(base, WindowOrder(n, seed=3)(0, np.arange(n)))  # a pure function
    assert not np.array_equal(base, WindowOrder(n, seed=4)(0, np.arange(n)))
    assert not np.array_equal(base, WindowOrder(n, seed=3)(1, np.arange(n)))
    assert not np.array_equal(base, np.arange(n))  # shuffled
    # any index on its own gives what it gives in the whole epoch
    picks = np.array([9_999, 0, 4_321])
    assert np.array_equal(WindowOrder(n, seed=3)(0, picks), base[picks])


def _read(cursors: dict[int, WindowCursor], sizes: list[int]) -> list[np.ndarray]:
    """Every worker takes each of ``sizes`` in turn (a round's b, the same for the trainer's workers)."""
    out = []
    for size in sizes:
        for cursor in cursors.values():
            out.append(cursor.take(size))
    return out


def test_within_an_epoch_every_window_is_drawn_once_over_all_workers():
    n, workers = 997, 4  # n not a multiple of the workers: the epoch's end falls mid-row
    cursors = {w: WindowCursor(n, 0, w, workers) for w in range(workers)}
    sizes = [3, 5, 5, 8, 13, 21, 34, 55, 89, 57]  # b changes between rounds
    windows = np.concatenate(_read(cursors, sizes))
    read = sum(sizes) * workers
    assert n < read < 2 * n
    # all n windows were drawn; the only repeats are the draws of the second epoch, one each at most
    counts = np.bincount(windows, minlength=n)
    assert counts.min() == 1 and counts.max() == 2 and int((counts == 2).sum()) == read - n
    # and which ones: positions 0 .. read-1 (worker w's i-th sample is position w + W·i), epoch by epoch
    one_reader = WindowCursor(n, 0, 0, 1)
    assert sorted(windows.tolist()) == sorted(one_reader.take(read).tolist())


def test_a_workers_samples_do_not_depend_on_how_they_are_grouped_into_steps():
    a, b = WindowCursor(500, 1, 2, 4), WindowCursor(500, 1, 2, 4)
    grouped = np.concatenate([a.take(s) for s in (3, 5, 2, 7, 1)])
    assert np.array_equal(grouped, b.take(18))


def test_a_cursor_resumes_exactly_at_any_count_and_in_constant_time():
    cursor = WindowCursor(123_457, 11, 1, 3)
    cursor.take(40)
    state = cursor.state_dict()
    again = WindowCursor(123_457, 11, 1, 3)
    again.load_state_dict(state)
    assert np.array_equal(again.take(25), cursor.take(25))

    far = dict(state, count=10**9)
    started = time.perf_counter()
    late = WindowCursor(123_457, 11, 1, 3)
    late.load_state_dict(far)
    first = late.take(32)
    assert time.perf_counter() - started < 5  # generous: a counter, nothing replayed (the benchmark times it)
    earlier = WindowCursor(123_457, 11, 1, 3)
    earlier.load_state_dict(dict(state, count=10**9 - 7))
    earlier.take(7)
    assert np.array_equal(earlier.take(32), first)


def test_a_cursor_refuses_a_state_of_other_files_or_another_sampler():
    cursor = WindowCursor(100, 0, 0, 2)
    with pytest.raises(DataError, match="have 100 windows, the run started on 99"):
        cursor.load_state_dict(dict(WindowCursor(99, 0, 0, 2).state_dict()))
    with pytest.raises(DataError, match="not one over token files"):
        cursor.load_state_dict({"generator": object()})


def _regroup(cursors: dict[int, WindowCursor], workers: int, n: int, seed: int) -> dict[int, WindowCursor]:
    ends = {w: cursor_end(c.state_dict()) for w, c in cursors.items()}
    states = regrouped(ends, n, workers)
    out = {}
    for w in range(workers):
        out[w] = WindowCursor(n, seed, w, workers)
        out[w].load_state_dict(states[w])
    return out


def test_elastic_four_three_four_workers_read_every_position_once():
    n, seed = 301, 5
    cursors = {w: WindowCursor(n, seed, w, 4) for w in range(4)}
    read = [*_read(cursors, [4, 6])]
    cursors = _regroup(cursors, 3, n, seed)
    assert all(c.base == 4 * 10 and c.stride == 3 for c in cursors.values())
    read += _read(cursors, [7, 2])
    cursors = _regroup(cursors, 4, n, seed)
    assert all(c.base == 40 + 3 * 9 and c.stride == 4 for c in cursors.values())
    read += _read(cursors, [5, 80])
    total = 40 + 27 + 4 * 85
    assert total > n
    # exactly the windows of positions 0 .. total-1, in the order one worker would have read them
    expected = WindowCursor(n, seed, 0, 1).windows_at(np.arange(total))
    assert sorted(np.concatenate(read).tolist()) == sorted(expected.tolist())
    for epoch_start in range(0, total - n + 1, n):  # each whole epoch: each window once
        assert sorted(expected[epoch_start : epoch_start + n].tolist()) == list(range(n))


def test_regrouping_after_uneven_reads_starts_past_the_furthest_worker():
    cursors = {w: WindowCursor(50, 0, w, 2) for w in range(2)}
    cursors[0].take(5)
    cursors[1].take(3)  # positions 1, 3, 5 read; 7 and 9 are skipped for this epoch
    states = regrouped({w: cursor_end(c.state_dict()) for w, c in cursors.items()}, 50, 3)
    assert {s["base"] for s in states.values()} == {10}
    assert [s["offset"] for s in states.values()] == [0, 1, 2]
