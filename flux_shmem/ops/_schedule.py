"""Tile orders of the fused GEMMs (pure functions, tested on the CPU).

The GEMM visits M-tiles in the order of a table; these functions make the tables:
  * AllGather+GEMM: my own shard first (already local), then my node's peers (NVLink, fast), then other nodes
    (in flight over the network meanwhile); each PE starts its rotation at its own index, so the PEs do not all
    wait on the same source at once.
  * GEMM+ReduceScatter: the reverse: segments that must cross nodes first, then my node's peers, my own last (it
    needs no transfer); rotated per PE so no PE is the target of every peer at once.
A tile that spans two segments is placed with the later of them, so it never waits longer than its neighbours.
The copy-engine all-gather's copy list (`ag_ce_copies`) lives here too.
"""
from __future__ import annotations

from typing import NamedTuple


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


class CeCopy(NamedTuple):
    dest: int         # PE whose gather buffer receives the chunk
    chunk: int
    offset: int       # byte offset in the gather buffer (the same on every PE) and...
    src_offset: int   # ...in the source shard
    nbytes: int
    flag: int         # index of the chunk's flag in `flags` (raised on `dest` after the data)


def ag_ce_copies(me: int, world: int, rows: int, chunk_rows: int, row_bytes: int) -> list[CeCopy]:
    """The copies PE `me` issues for one all-gather of `rows`-row shards, in issue order: its own buffer first
    (its GEMM starts there), then chunk by chunk to the peers in a rotation from me + 1, so every peer gets the first
    chunks of every shard early. Layout as the SM engine's: shard s at rows [s*rows, (s+1)*rows), flag of (s, c) at
    s * chunks + c."""
    if min(world, rows, chunk_rows, row_bytes) <= 0 or not 0 <= me < world:
        raise ValueError(f"bad all-gather geometry: me={me} world={world} rows={rows} chunk_rows={chunk_rows} "
                         f"row_bytes={row_bytes}")
    chunks = -(-rows // chunk_rows)
    order = [(me, c) for c in range(chunks)] + [((me + i) % world, c) for c in range(chunks) for i in range(1, world)]
    out = []
    for dest, c in order:
        r0 = c * chunk_rows
        out.append(CeCopy(dest, c, (me * rows + r0) * row_bytes, r0 * row_bytes,
                          min(chunk_rows, rows - r0) * row_bytes, me * chunks + c))
    return out
