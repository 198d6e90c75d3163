"""Tile orders of the fused GEMMs (pure functions, tested on the CPU).

The GEMM visits M-tiles in the order of a table; these functions make the tables:
  * AllGather+GEMM: my own shard first (already local), then my node's peers (NVLink, fast), then other nodes
    (in flight over the network meanwhile); each PE starts its rotation at its own index, so the PEs do not all
    wait on the same source at once.
  * GEMM+ReduceScatter: the reverse: segments that must cross nodes first, then my node's peers, my own last (it
    needs no transfer); rotated per PE so no PE is the target of every peer at once.
A tile that spans two segments is placed with the later of them, so it never waits longer than its neighbours.
"""
from __future__ import annotations


def ag_segment_order(me: int, world: int, node_size: int) -> list[int]:
    L, nodes = node_size, world // node_size
    n, l = divmod(me, L)
    order = [n * L + (l + i) % L for i in range(L)]
    for j in range(1, nodes):
        nn = (n + j) % nodes
        order += [nn * L + (l + i) % L for i in range(L)]
    return order


def rs_segment_order(me: int, world: int, node_size: int) -> list[int]:
    L, nodes = node_size, world // node_size
    n, l = divmod(me, L)
    order = []
    for j in range(1, nodes):
        nn = (n + j) % nodes
        order += [nn * L + (l + i) % L for i in range(L)]
    order += [n * L + (l + i) % L for i in range(1, L)]
    return order + [me]


def m_tile_order(segment_order: list[int], m: int, rows_per_segment: int, tile_m: int) -> list[int]:
    """Every M-tile of an M-row output exactly once, in the order of the segments its rows belong to."""
    if m <= 0 or rows_per_segment <= 0 or tile_m <= 0:
        raise ValueError(f"m={m}, rows_per_segment={rows_per_segment}, tile_m={tile_m} must be positive")
    pos = {s: i for i, s in enumerate(segment_order)}
    tiles = -(-m // tile_m)

    def key(t: int) -> tuple[int, int]:
        lo, hi = t * tile_m, min(m, (t + 1) * tile_m) - 1
        segs = range(lo // rows_per_segment, hi // rows_per_segment + 1)
        return max(pos[s] for s in segs), t
    return sorted(range(tiles), key=key)
