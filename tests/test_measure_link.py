"""``plan.measure_link``: the running group's point-to-point link, for checking an estimate of
``plan.cost`` against a measured run on the same machine (benchmarks/relayout.py)."""
import pytest
import torch.distributed as dist

from dtensor_lite.plan.measure_link import measure_link
from tests.harness import distributed


@distributed(world_size=3)
def test_every_rank_gets_the_same_positive_link():
    link = measure_link(big_bytes=2**16, repeats=2)
    assert link.bandwidth > 0 and link.latency >= 0
    mine = [link.bandwidth, link.latency]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(e == mine for e in everyone)  # measured by ranks 0 and 1, broadcast to all
    sub = dist.new_group([1, 2])
    if dist.get_rank() in (1, 2):
        assert measure_link(sub, big_bytes=2**12, repeats=1).bandwidth > 0


@distributed(world_size=2)
def test_a_group_of_one_rank_is_refused():
    alone = dist.new_group([0])
    other = dist.new_group([1])
    with pytest.raises(ValueError, match="at least 2 ranks"):
        measure_link(alone if dist.get_rank() == 0 else other)
