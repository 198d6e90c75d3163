"""Node layout and the kernels' group size, from gathered host names and reachability."""
import pytest

from flux_shmem.runtime.topology import kernel_node_size, layout_from_hosts


def full(n):
    return [[True] * n for _ in range(n)]


def test_layout_two_nodes():
    hosts = ["a", "a", "b", "b"]
    lay = layout_from_hosts(hosts, 3)
    assert (lay.rank, lay.world_size, lay.local_rank, lay.local_size, lay.node, lay.num_nodes) == (3, 4, 1, 2, 1, 2)
    assert layout_from_hosts(hosts, 0).node == 0


def test_layout_interleaved_and_uneven():
    lay = layout_from_hosts(["a", "b", "a"], 2)
    assert (lay.local_rank, lay.local_size, lay.node, lay.num_nodes) == (1, 2, 0, 2)
    with pytest.raises(ValueError):
        layout_from_hosts(["a"], 1)


def test_node_size_single_host_and_forced_put():
    assert kernel_node_size(["a"] * 8, full(8)) == 8
    assert kernel_node_size(["a"] * 8, full(8), force_put=True) == 1
    assert kernel_node_size(["a"] * 8, full(8), override=4) == 4
    with pytest.raises(ValueError):
        kernel_node_size(["a"] * 8, full(8), override=3)


def test_node_size_multi_node():
    hosts = ["a"] * 4 + ["b"] * 4
    reach = [[p // 4 == q // 4 for q in range(8)] for p in range(8)]
    assert kernel_node_size(hosts, reach) == 4


def test_node_size_falls_back_to_puts():
    with pytest.warns(UserWarning, match="ranks grouped by node"):
        assert kernel_node_size(["a", "b", "a", "b"], full(4)) == 1  # interleaved ranks
    reach = full(4)
    reach[0][1] = False  # a pair on one host without P2P mapping
    with pytest.warns(UserWarning):
        assert kernel_node_size(["a"] * 4, reach) == 1
