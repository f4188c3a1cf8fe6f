import pytest
import torch

from adloco.algorithms.batch_tests import GroupedGradient
from adloco.algorithms.sharding import join_shards, local_shard, recut, shard_rows, shard_shape


@pytest.mark.parametrize(("rows", "count"), [(10, 4), (2, 4), (7, 2), (1, 3), (64, 8)])
def test_shards_cut_rows_as_torch_chunk_does(rows, count):
    """FSDP2 cuts dim 0 with torch.chunk and pads missing chunks with empty ones: the same rows, shard by shard."""
    chunks = torch.chunk(torch.arange(rows), count)
    for index in range(count):
        start, stop = shard_rows(rows, index, count)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == expected


def test_a_tensor_comes_back_whole_from_its_shards():
    tensor = torch.randn(5, 3)
    shards = [local_shard(tensor, i, 4) for i in range(4)]
    assert (
        [tuple(s.shape) for s in shards]
        == [shard_shape((5, 3), i, 4) for i in range(4)]
        == [(2, 3), (2, 3), (1, 3), (0, 3)]
    )
    assert torch.equal(join_shards(shards), tensor)
    shards[0][0, 0] = 99.0  # each shard owns its memory
    assert tensor[0, 0] != 99.0


def test_there_is_no_shard_past_the_count():
    with pytest.raises(ValueError, match="shard 2 of 2"):
        shard_rows(4, 2, 2)


@pytest.mark.parametrize("gram", [False, True])
def test_statistics_of_a_sharded_gradient_add_up_to_those_of_the_whole(gram):
    """Each shard holds some rows of every group's gradient; summing the shards' partial sums gives the statistics
    of the whole gradient, as a sharded worker's ranks do over their shard group."""
    torch.manual_seed(0)
    sizes = [3, 3, 2]
    means = [torch.randn(10) for _ in sizes]
    whole = GroupedGradient(sizes, 10, gram, torch.device("cpu"))
    halves = [GroupedGradient(sizes, n, gram, torch.device("cpu")) for n in (6, 4)]
    for mean, size in zip(means, sizes, strict=True):
        whole.add(mean, size)
        halves[0].add(mean[:6], size)
        halves[1].add(mean[6:], size)
    partial: list[torch.Tensor] = []
    for half in halves:
        half.statistics(lambda sums: partial.append(sums) or sums)
    summed = partial[0] + partial[1]
    expected, got = whole.statistics(), halves[0].statistics(lambda sums: summed)
    assert got.sample_variance == pytest.approx(expected.sample_variance, rel=1e-12)
    assert got.grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-12)
    if gram:
        assert got.ip_variance == pytest.approx(expected.ip_variance, rel=1e-9)


def test_a_state_saved_by_two_shards_is_cut_anew_for_three():
    """Parameter rows (θ, moments) are joined and cut again; what every shard holds alike is taken once."""
    shapes = {(5, 2), (4,)}
    weight, norm, moment = torch.randn(5, 2), torch.randn(4), torch.randn(5, 2)
    stream = torch.arange(4, dtype=torch.uint8)  # a generator state: the same on every shard, never cut

    def saved(index: int, count: int) -> dict:
        return {
            "theta": [local_shard(weight, index, count), local_shard(norm, index, count)],
            "optimizer": {0: {"step": torch.tensor(7.0), "exp_avg": local_shard(moment, index, count)}},
            "stream": stream.clone(),
            "round": 3,
        }

    columns = [saved(0, 2), saved(1, 2)]
    for index in range(3):
        state = recut(columns, index, 3, shapes)
        expected = saved(index, 3)
        assert all(torch.equal(a, b) for a, b in zip(state["theta"], expected["theta"], strict=True))
        assert torch.equal(state["optimizer"][0]["exp_avg"], expected["optimizer"][0]["exp_avg"])
        assert float(state["optimizer"][0]["step"]) == 7.0 and state["round"] == 3
        assert torch.equal(state["stream"], stream)
    whole = recut([saved(0, 1)], 0, 1, shapes)  # one shard to one: the state as it was
    assert torch.equal(whole["theta"][0], weight)
