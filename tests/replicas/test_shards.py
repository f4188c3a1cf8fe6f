"""The ranks of a sharded replica agree on the round they go on from (the kill test of sharded replicas is in
tests/replicas/test_training.py)."""

from adloco.replicas.shards import common_round


def test_the_ranks_go_on_from_the_newest_round_every_one_of_them_saved():
    assert common_round([[2, 4], [2, 4]]) == 4
    assert common_round([[2, 4, 6], [2, 4]]) == 4  # a crash between the two ranks' writes of round 6
    assert common_round([[4], [2]]) is None  # keeping one each leaves nothing in common: why at least two are kept
    assert common_round([[], []]) is None
