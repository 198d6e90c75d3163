"""Where each PE is: node index and local rank from host names, and the group size the kernels use.

Pure functions of gathered facts, so they are tested without MPI or GPUs.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Layout:
    rank: int
    world_size: int
    local_rank: int    # index among the PEs of this host
    local_size: int    # PEs on this host
    node: int          # host index, in order of first appearance by rank
    num_nodes: int


def layout_from_hosts(hosts: Sequence[str], rank: int) -> Layout:
    """Layout of `rank` given every rank's host name (index = rank)."""
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} outside world of {len(hosts)}")
    order: list[str] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    mine = hosts[rank]
    same = [r for r, h in enumerate(hosts) if h == mine]
    return Layout(rank, len(hosts), same.index(rank), len(same), order.index(mine), len(order))


def kernel_node_size(hosts: Sequence[str], reachable: Sequence[Sequence[bool]], *, force_put: bool = False,
                     override: int | None = None) -> int:
    """The group size L the two-level kernels use: PEs [n*L, (n+1)*L) reach each other by load/store.

    `reachable[p][q]`: PE p maps PE q's symmetric heap (nvshmem_ptr != NULL). L is the host size when every host
    holds the same number of consecutive ranks and they all reach each other; otherwise 1 (every peer through
    NVSHMEM put, correct but without the NVLink shortcut). `force_put` gives 1; `override` (FLUX_SHMEM_NODE_SIZE)
    splits hosts into smaller groups, to exercise the inter-node path on one host.
    """
    world = len(hosts)
    if force_put:
        return 1
    local = hosts.count(hosts[0])
    consecutive = world % local == 0 and all(
        hosts[i] == hosts[(i // local) * local] and hosts.count(hosts[i]) == local for i in range(world))
    if consecutive:
        groups_ok = all(reachable[p][q] for p in range(world) for q in range(world) if p // local == q // local)
    else:
        groups_ok = False
    size = local if groups_ok else 1
    if not groups_ok and world > 1:
        warnings.warn("flux_shmem: ranks are not laid out as equal blocks of mutually load/store-reachable PEs "
                      "per host; every peer will be reached by NVSHMEM put (slower inside a node). Launch with "
                      "ranks grouped by node (mpirun --map-by ppr:G:node) to enable the NVLink path.", stacklevel=2)
    if override is not None:
        if override < 1 or size % override != 0:
            raise ValueError(f"FLUX_SHMEM_NODE_SIZE={override} must be >= 1 and divide the load/store group size "
                             f"{size}")
        size = override
    return size
