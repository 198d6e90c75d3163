"""Schedules of the fused ops, as pure functions: the one place that decides who sends what, in which order, and
in which order the GEMM visits its tiles. The kernels read these as tables (no schedule logic in C++), and the
simulator (`flux_shmem.ops.simulate`) runs exactly these functions, so what is modelled is what runs.

PEs are grouped in nodes of L consecutive PEs that reach each other by load/store (NVLink); between nodes only
NVSHMEM puts work, and only to the PE with the same local index (two-level). L = 1 makes every peer remote (the
forced-put path).

All-gather (AG+GEMM), per PE: copy my shard into my own slot of the gather buffer (local tiles start at once); put
it to the other nodes (IB, in flight while NVLink works); store it into my node peers' buffers; forward what came
over the network to my node peers. Each phase is a ring shift, shard-major: in step i every PE sends to PE
me - i, so every destination receives from one source at a time, whole shards in chunk order. The GEMM visits its
M-tiles in the order their rows are predicted to arrive (`ag_tile_order`, fed by the simulator), so it consumes in
the order the data lands.

Reduce-scatter (GEMM+RS): the PEs of a node compute in one common order: other nodes' segments first (so each
node-level sum is complete early and its network put starts while the GEMM runs), then their own node's, every
phase interleaved by M-tile (tile t of every segment, then tile t + 1). An M-tile of a segment is therefore done
on all node peers at about the same time, and the segment's reducer sums the node's partials of it right then, in
one pass (L reads, one write, fp32 in registers): segments complete steadily through the GEMM, and what is left
after it is the reduction of its last wave. (Holding partial sums in a buffer until a PE's own tile is ready, the
alternative, costs 8 bytes of memory traffic per element per step: measured too slow for the few SMs the comm
kernel may take.)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

# ------------------------------------------------------------------------------------------------------------
# All-gather
def fused_chunk_rows(rows_per_shard: int, row_bytes: int, tile_m: int) -> int:
    """AllGatherGEMM's chunk: about 1 MiB (a power of two of rows, 16 to tile_m). Each comm block moves one chunk
    at a time, so the first rows a peer's GEMM needs arrive after one chunk's transfer, not a shard's."""
    rows = 16
    while rows < tile_m and rows * 2 * row_bytes <= 1 << 20:
        rows *= 2
    return max(1, min(rows_per_shard, rows))


LOCAL, PUT, DIRECT, FORWARD = 0, 1, 2, 3  # csrc/collectives.cu AgKind
AG_KINDS = {LOCAL: "local", PUT: "put", DIRECT: "direct", FORWARD: "forward"}


class AgUnit(NamedTuple):
    kind: int
    src: int     # PE whose shard this chunk is
    dest: int    # PE whose gather buffer receives it
    chunk: int


def _topo(me: int, world: int, node_size: int) -> tuple[int, int, int, int]:
    if world < 1 or node_size < 1 or world % node_size or not 0 <= me < world:
        raise ValueError(f"bad topology: me={me} world={world} node_size={node_size} (world must be a multiple of "
                         "node_size)")
    L = node_size
    return L, world // L, me // L, me % L


def ag_units(me: int, world: int, node_size: int, chunks: int) -> list[AgUnit]:
    """Every unit of work PE `me` does for one all-gather, in issue order (module docstring)."""
    L, nodes, n, l = _topo(me, world, node_size)
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    pe = lambda node, local: (node % nodes) * L + local % L  # noqa: E731
    out = [AgUnit(LOCAL, me, me, c) for c in range(chunks)]
    out += [AgUnit(PUT, me, pe(n - j, l), c) for j in range(1, nodes) for c in range(chunks)]
    out += [AgUnit(DIRECT, me, pe(n, l - i), c) for i in range(1, L) for c in range(chunks)]
    # Node n + j sent its shard to me in step j; pass each chunk on as soon as it is here.
    out += [AgUnit(FORWARD, pe(n + j, l), pe(n, l - i), c)
            for j in range(1, nodes) for c in range(chunks) for i in range(1, L)]
    return out


def round_robin(items: Sequence, blocks: int) -> list[list]:
    """Item i to block i % blocks, each block keeping issue order."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    per = [[] for _ in range(blocks)]
    for i, it in enumerate(items):
        per[i % blocks].append(it)
    return per


def ag_plan(me: int, world: int, node_size: int, chunks: int, blocks: int) -> list[list[AgUnit]]:
    """The all-gather kernel's work, per thread block."""
    return round_robin(ag_units(me, world, node_size, chunks), blocks)


class CeCopy(NamedTuple):
    dest: int         # PE whose gather buffer receives the chunk
    chunk: int
    offset: int       # byte offset in the gather buffer (the same on every PE) and...
    src_offset: int   # ...in the source shard
    nbytes: int
    flag: int         # index of the chunk's flag (raised on `dest` after the data)


def ag_ce_copies(me: int, world: int, rows: int, chunk_rows: int, row_bytes: int) -> list[CeCopy]:
    """The copy-engine all-gather (one NVLink domain): the units of `ag_units` with L = world, as copies in issue
    order. Layout as the SM engine's: shard s at rows [s*rows, (s+1)*rows), flag of (s, c) at s * chunks + c."""
    if min(world, rows, chunk_rows, row_bytes) <= 0 or not 0 <= me < world:
        raise ValueError(f"bad all-gather geometry: me={me} world={world} rows={rows} chunk_rows={chunk_rows} "
                         f"row_bytes={row_bytes}")
    chunks = -(-rows // chunk_rows)
    out = []
    for u in ag_units(me, world, world, chunks):
        r0 = u.chunk * chunk_rows
        out.append(CeCopy(u.dest, u.chunk, (me * rows + r0) * row_bytes, r0 * row_bytes,
                          min(chunk_rows, rows - r0) * row_bytes, me * chunks + u.chunk))
    return out


def tile_chunks(tile: int, tile_m: int, m: int, rows_per_shard: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The (shard, chunk) pairs holding rows of M-tile `tile` (csrc tile_schedule.cuh chunk_span_for_tile)."""
    lo, hi = tile * tile_m, min(m, (tile + 1) * tile_m)
    out = []
    for s in range(lo // rows_per_shard, (hi - 1) // rows_per_shard + 1):
        a, b = max(lo, s * rows_per_shard) - s * rows_per_shard, min(hi, (s + 1) * rows_per_shard) - s * rows_per_shard
        out += [(s, c) for c in range(a // chunk_rows, (b - 1) // chunk_rows + 1)]
    return out


def ag_tile_order(m: int, tile_m: int, rows_per_shard: int, chunk_rows: int,
                  arrival: dict[tuple[int, int], float]) -> list[int]:
    """M-tiles sorted by when the last chunk they need arrives (`arrival[(shard, chunk)]`, e.g. from
    `simulate.ag_arrivals`), ties in row order."""
    if m <= 0 or tile_m <= 0 or rows_per_shard <= 0 or chunk_rows <= 0:
        raise ValueError(f"m={m}, tile_m={tile_m}, rows_per_shard={rows_per_shard}, chunk_rows={chunk_rows} must "
                         "be positive")
    tiles = -(-m // tile_m)
    ready = [max(arrival[sc] for sc in tile_chunks(t, tile_m, m, rows_per_shard, chunk_rows)) for t in range(tiles)]
    return sorted(range(tiles), key=lambda t: (ready[t], t))


# ------------------------------------------------------------------------------------------------------------
# Reduce-scatter
def rs_segment_phases(me: int, world: int, node_size: int) -> list[list[int]]:
    """The segments PE `me`'s GEMM computes, as phases in order: other nodes' (nearest first), then my node's; the
    same lists on every PE of a node."""
    L, nodes, n, l = _topo(me, world, node_size)
    remote = [((n + j) % nodes) * L + i for j in range(1, nodes) for i in range(L)]
    return [remote, [n * L + i for i in range(L)]]


def rs_tile_order(me: int, world: int, node_size: int, m: int, tile_m: int) -> list[int]:
    """GEMM+RS M-tile order: phase by phase (`rs_segment_phases`), inside a phase interleaved by M-tile (tile t of
    every segment of the phase, then tile t + 1, ...). A tile spanning two segments goes with the later one."""
    if m <= 0 or tile_m <= 0 or m % world:
        raise ValueError(f"m={m} must be a positive multiple of world={world}; tile_m={tile_m} positive")
    ms = m // world
    key_of_seg = {}
    for p, segs in enumerate(rs_segment_phases(me, world, node_size)):
        for i, s in enumerate(segs):
            key_of_seg[s] = (p, i)

    def key(t: int) -> tuple:
        lo, hi = t * tile_m, min(m, (t + 1) * tile_m)
        ks = []
        for s in range(lo // ms, (hi - 1) // ms + 1):
            p, i = key_of_seg[s]
            ks.append((p, (max(lo, s * ms) - s * ms) // tile_m, i))
        return max(ks) + (t,)
    return sorted(range(-(-m // tile_m)), key=key)


def default_unit_rows(cols: int, elem: int, tile_m: int = 128) -> int:
    """Reduce-scatter rows per unit of work: a power of two dividing tile_m, about 128 KiB of one addend."""
    rows = 1
    while rows < tile_m and rows * 2 * cols * elem <= 128 * 1024:
        rows *= 2
    return rows


def rs_unit_rows(ms: int, unit_rows: int, seg: int, u: int) -> tuple[int, int]:
    """Global rows [lo, hi) of unit u of segment seg: segments cut at multiples of unit_rows (which divides the
    GEMM tile height, so a unit never spans two M-tiles)."""
    seg_lo, seg_hi = seg * ms, (seg + 1) * ms
    a = (seg_lo // unit_rows + u) * unit_rows
    return max(a, seg_lo), min(a + unit_rows, seg_hi)


def rs_units_in_segment(ms: int, unit_rows: int, seg: int) -> int:
    lo, hi = seg * ms, (seg + 1) * ms
    return -(-hi // unit_rows) - lo // unit_rows


def rs_max_units(ms: int, unit_rows: int) -> int:
    """Receive-signal slots per node: an upper bound of units per segment (any segment)."""
    return ms // unit_rows + 2


COPY, NODE_SUM, FINAL = 0, 1, 2  # csrc/collectives.cu RsOp
RS_OPS = {COPY: "copy", NODE_SUM: "node_sum", FINAL: "final"}


class RsItem(NamedTuple):
    op: int
    seg: int     # segment (= owning PE); COPY: -1
    unit: int    # unit index inside the segment; COPY: copy unit over all M rows


def rs_items(me: int, world: int, node_size: int, m: int, unit_rows: int, tile_m: int,
             copy_rows: int = 0) -> list[tuple[RsItem, int]]:
    """PE `me`'s reduce-scatter work as (item, affinity) in issue order; an item with affinity a >= 0 must run after
    item a of this list in the same thread block. copy_rows > 0: the standalone op, which first copies its
    [copy_rows, N] input into its symmetric addend in units of unit_rows rows.

      NODE_SUM(s, u)  every segment s with my local index (every node's): sum my node's partials of the unit, in
                      the order the GEMM completes its M-tile; one node: the result; else the node partial, sent to
                      PE s (kept in my receive slot when s is mine)
      FINAL(s, u)     s = me, several nodes: sum the node partials in node order (after my NODE_SUM of the unit)
    """
    L, nodes, n, l = _topo(me, world, node_size)
    if m <= 0 or m % world or unit_rows <= 0 or tile_m % unit_rows:
        raise ValueError(f"m={m} (a positive multiple of world={world}), unit_rows={unit_rows} (dividing "
                         f"tile_m={tile_m}) are required")
    ms = m // world
    out: list[tuple[RsItem, int]] = []
    if copy_rows:
        out += [(RsItem(COPY, -1, cu), -1) for cu in range(-(-copy_rows // unit_rows))]
    pos = {t: i for i, t in enumerate(rs_tile_order(me, world, node_size, m, tile_m))}
    mine = [s for s in sum(rs_segment_phases(me, world, node_size), []) if s % L == l]
    sums = [RsItem(NODE_SUM, s, u) for s in mine for u in range(rs_units_in_segment(ms, unit_rows, s))]
    sums.sort(key=lambda it: (pos[rs_unit_rows(ms, unit_rows, it.seg, it.unit)[0] // tile_m], it.seg, it.unit))
    first = len(out)
    out += [(it, -1) for it in sums]
    if nodes > 1:
        at = {it.unit: first + i for i, it in enumerate(sums) if it.seg == me}
        out += [(RsItem(FINAL, me, u), at[u]) for u in range(rs_units_in_segment(ms, unit_rows, me))]
    return out


def rs_plan(me: int, world: int, node_size: int, m: int, unit_rows: int, tile_m: int, blocks: int,
            copy_rows: int = 0) -> list[list[RsItem]]:
    """The reduce-scatter kernel's work per thread block: items round-robin in issue order, an item with affinity
    on the block of the item it follows (FINAL items come after every NODE_SUM of a block, so no block waits on
    an item behind it)."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    per: list[list[RsItem]] = [[] for _ in range(blocks)]
    block_of: list[int] = []
    rr = 0
    for item, aff in rs_items(me, world, node_size, m, unit_rows, tile_m, copy_rows):
        b = block_of[aff] if aff >= 0 else rr % blocks
        rr += aff < 0
        per[b].append(item)
        block_of.append(b)
    return per


def rs_split_tail(per_block: list[list[RsItem]], order: list[int], tail_tiles: int, ms: int, unit_rows: int,
                  tile_m: int, tail_blocks: int) -> tuple[list[list[RsItem]], list[list[RsItem]]]:
    """Move the items of the last `tail_tiles` M-tiles of the GEMM `order` out of a reduce plan into a second one of
    `tail_blocks` blocks, which a fused call launches after the GEMM, when every SM is free again: the reduction of
    the GEMM's last wave then runs wide instead of on the few blocks that ran beside the GEMM. Items keep their
    order in either plan (round-robin in the tail)."""
    tail = set(order[len(order) - tail_tiles:]) if tail_tiles > 0 else set()
    if not tail:
        return per_block, []

    def tile_of(it: RsItem) -> int:
        return rs_unit_rows(ms, unit_rows, it.seg, it.unit)[0] // tile_m
    main = [[it for it in b if it.op == COPY or tile_of(it) not in tail] for b in per_block]
    moved = [it for b in per_block for it in b if it.op != COPY and tile_of(it) in tail]
    moved.sort(key=lambda it: (it.op, order.index(tile_of(it)), it.seg, it.unit))  # NODE_SUMs, then FINALs
    return main, round_robin(moved, tail_blocks) if moved else []


def plan_table(per_block: Sequence[Sequence[Sequence[int]]]) -> tuple[list[int], list[int]]:
    """(flat int32 entries, 4 per item, padded with zeros; per-block start offsets, blocks + 1 of them) as the
    kernels read a plan."""
    flat: list[int] = []
    offsets = [0]
    for items in per_block:
        for it in items:
            row = list(it) + [0] * (4 - len(it))
            if len(row) != 4:
                raise ValueError(f"plan item {it} has more than 4 fields")
            flat += row
        offsets.append(len(flat) // 4)
    return flat, offsets


def plan_tensors(per_block: Sequence[Sequence[Sequence[int]]], device: str, multiple: int = 1) -> tuple:
    """A plan on the device as a kernel reads it: (int32 items [n, 4], int32 block offsets, blocks), blocks with no
    work dropped (the kernel's grid is the blocks that have work), then idle blocks added up to a multiple of
    `multiple` (a grid launched in clusters). The only function here that needs torch."""
    import torch
    per_block = [b for b in per_block if b] or [[]]
    per_block += [[] for _ in range(-len(per_block) % multiple)]
    flat, offsets = plan_table(per_block)
    return (torch.tensor(flat or [0, 0, 0, 0], dtype=torch.int32, device=device),
            torch.tensor(offsets, dtype=torch.int32, device=device), len(per_block))
