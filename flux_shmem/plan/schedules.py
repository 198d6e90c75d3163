"""Schedules of the fused ops, as pure functions: the one place that decides who sends what, in which order, and
in which order the GEMM visits its tiles. The kernels read these as tables (no schedule logic in C++), and the
simulator (`flux_shmem.plan.simulate`) runs exactly these functions, so what is modelled is what runs.

PEs are grouped in nodes of L consecutive PEs that reach each other by load/store (NVLink); between nodes only
NVSHMEM puts work, and only to the PE with the same local index (two-level). L = 1 makes every peer remote (the
forced-put path).

All-gather (AG+GEMM), per PE: copy my shard into my own slot of the gather buffer (local tiles start at once); put
it to the other nodes (IB, in flight while NVLink works); store it into my node peers' buffers; forward what came
over the network to my node peers. Each phase is a ring shift, shard-major: in step i every PE sends to PE
me - i, so every destination receives from one source at a time, whole shards in chunk order. A put lands on the
receiver's receive flag, which its own kernel waits on the NVSHMEM way (ACCEPT: on proxy transports that wait also
makes the data visible) before raising the chunk flag its GEMM and forwards read. The GEMM visits its
M-tiles in the order their rows are predicted to arrive (`ag_tile_order`, fed by the simulator), so it consumes in
the order the data lands.

Reduce-scatter (GEMM+RS): the PEs of a node compute in one common order: other nodes' segments first (so each
node-level sum is complete early and its network put starts while the GEMM runs), then their own node's, every
phase interleaved by M-tile (tile t of every segment, then tile t + 1). A tile of a segment is therefore done on
all node peers at about the same time, and the segment's reducer sums the node's partials of it right then, in
one pass (L reads, one write, fp32 in registers): segments complete steadily through the GEMM, and what is left
after it is the reduction of its last wave. Units are rows x a group of N-tiles (`RsUnits`) and wait only for the
tiles under them; with a GEMM swizzle of several cluster rows (tile t of several segments side by side), each wave
completes a column group of as many owners' rows, so the last wave's reductions are spread over the PEs rather
than left to the owners of its few M-tiles. (Holding partial sums in a buffer until a PE's own tile is ready, the
alternative, costs 8 bytes of memory traffic per element per step: measured too slow for the few SMs the comm
kernel may take.)
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

# ------------------------------------------------------------------------------------------------------------
# All-gather
def fused_chunk_rows(rows_per_shard: int, row_bytes: int, tile_m: int) -> int:
    """AllGatherGEMM's chunk: about 1 MiB (a power of two of rows, 16 to tile_m). Each comm block moves one chunk
    at a time, so the first rows a peer's GEMM needs arrive after one chunk's transfer, not a shard's."""
    rows = 16
    while rows < tile_m and rows * 2 * row_bytes <= 1 << 20:
        rows *= 2
    return max(1, min(rows_per_shard, rows))


LOCAL, PUT, DIRECT, FORWARD, ACCEPT = 0, 1, 2, 3, 4  # csrc/collectives.cu AgKind
AG_KINDS = {LOCAL: "local", PUT: "put", DIRECT: "direct", FORWARD: "forward", ACCEPT: "accept"}


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


def ag_units(me: int, world: int, node_size: int, chunks: int, chunk_major: bool = False) -> list[AgUnit]:
    """Every unit of work PE `me` does for one all-gather, in issue order (module docstring). chunk_major: my sends
    chunk by chunk (chunk 0 to every destination, then chunk 1, ...) instead of destination by destination, for a
    consumer that waits for chunk c of every shard at once (the MoE ops' pipelined grouped GEMMs)."""
    L, nodes, n, l = _topo(me, world, node_size)
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    pe = lambda node, local: (node % nodes) * L + local % L  # noqa: E731
    out = [AgUnit(LOCAL, me, me, c) for c in range(chunks)]
    if chunk_major:
        for c in range(chunks):
            out += [AgUnit(PUT, me, pe(n - j, l), c) for j in range(1, nodes)]
            out += [AgUnit(DIRECT, me, pe(n, l - i), c) for i in range(1, L)]
    else:
        out += [AgUnit(PUT, me, pe(n - j, l), c) for j in range(1, nodes) for c in range(chunks)]
        out += [AgUnit(DIRECT, me, pe(n, l - i), c) for i in range(1, L) for c in range(chunks)]
    # Node n + j sent its shard to me in step j (a put, signalled on my receive flag): accept each chunk as it
    # lands (NVSHMEM's wait, which makes the put's data visible here, then its flag for my GEMM), and pass it on.
    for j in range(1, nodes):
        for c in range(chunks):
            out.append(AgUnit(ACCEPT, pe(n + j, l), me, c))
            out += [AgUnit(FORWARD, pe(n + j, l), pe(n, l - i), c) for i in range(1, L)]
    return out


def round_robin(items: Sequence, blocks: int) -> list[list]:
    """Item i to block i % blocks, each block keeping issue order."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    per = [[] for _ in range(blocks)]
    for i, it in enumerate(items):
        per[i % blocks].append(it)
    return per


def ag_plan(me: int, world: int, node_size: int, chunks: int, blocks: int, chunk_major: bool = False
            ) -> list[list[AgUnit]]:
    """The all-gather kernel's work, per thread block."""
    return round_robin(ag_units(me, world, node_size, chunks, chunk_major), blocks)


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


def chunk_step_of_tiles(m: int, seg_rows: int, chunk_rows: int, tile_m: int) -> list[int]:
    """For a producer that writes an [m, n] reduce-scatter addend in steps, step s writing rows
    [p*seg_rows + s*chunk_rows, p*seg_rows + (s+1)*chunk_rows) of every segment p (the MoE ops' pipelined grouped
    GEMM + combine): the step after which each M-tile of tile_m rows is complete (the last step of its rows)."""
    if min(m, seg_rows, chunk_rows, tile_m) <= 0 or m % seg_rows:
        raise ValueError(f"bad chunked addend: m={m} seg_rows={seg_rows} (must divide m) chunk_rows={chunk_rows} "
                         f"tile_m={tile_m}")
    out = []
    for t in range(-(-m // tile_m)):
        lo, hi = t * tile_m, min(m, (t + 1) * tile_m) - 1  # (hi: the tile's last row)
        out.append(max((min(hi, (seg + 1) * seg_rows - 1) - seg * seg_rows) // chunk_rows
                       for seg in range(lo // seg_rows, hi // seg_rows + 1)))
    return out


def chunk_completion(m: int, seg_rows: int, chunk_rows: int, tile_m: int) -> list[tuple[int, int]]:
    """`rs_completion` of a chunked producer (`chunk_step_of_tiles`, whole rows): (M-tile, 0) pieces by step."""
    step = chunk_step_of_tiles(m, seg_rows, chunk_rows, tile_m)
    return sorted(((t, 0) for t in range(len(step))), key=lambda p: (step[p[0]], p[0]))


def default_unit_rows(cols: int, elem: int, tile_m: int = 128) -> int:
    """Reduce-scatter rows per unit of work: a power of two dividing tile_m, about 128 KiB of one addend."""
    rows = 1
    while rows < tile_m and rows * 2 * cols * elem <= 128 * 1024:
        rows *= 2
    return rows


def rs_unit_rows(ms: int, unit_rows: int, seg: int, r: int) -> tuple[int, int]:
    """Global rows [lo, hi) of row unit r of segment seg: segments cut at multiples of unit_rows (which divides the
    GEMM tile height, so a unit never spans two M-tiles)."""
    seg_lo, seg_hi = seg * ms, (seg + 1) * ms
    a = (seg_lo // unit_rows + r) * unit_rows
    return max(a, seg_lo), min(a + unit_rows, seg_hi)


def rs_row_units(ms: int, unit_rows: int, seg: int) -> int:
    """Row units of segment seg (rs_unit_rows r = 0 .. this - 1)."""
    lo, hi = seg * ms, (seg + 1) * ms
    return -(-hi // unit_rows) - lo // unit_rows


def rs_max_units(ms: int, unit_rows: int, groups: int = 1) -> int:
    """Receive-signal slots per node: an upper bound of units per segment (any segment) with up to `groups` column
    groups."""
    return (ms // unit_rows + 2) * groups


class RsRect(NamedTuple):
    lo: int     # global rows [lo, hi)
    hi: int
    c0: int     # columns [c0, c1)
    c1: int
    slot: int   # element offset of the unit's node partial (packed rows x (c1 - c0)) in its segment's [ms, n] slot


@dataclasses.dataclass(frozen=True)
class RsUnits:
    """How one reduce-scatter call cuts the segments (ms rows each, n columns) into units of work: rows in units of
    unit_rows (inside one M-tile of tile_m rows), columns in groups of group_tiles N-tiles of tile_n columns (the
    last group narrower). Unit u of a segment is row unit u // groups, column group u % groups.

    The GEMM marks each of its (M-tile, N-tile) tiles done, and a unit waits only for the tiles under it: with
    narrow groups a unit can be reduced before its whole M-tile row is done (the standalone op: tile_n = n, one
    group). csrc comm_schedule.cuh rs_unit is the C++ twin. Made by `rs_units`, which checks the fields."""

    ms: int
    unit_rows: int
    tile_m: int
    n: int
    tile_n: int
    group_tiles: int
    tiles_n: int = dataclasses.field(init=False)
    groups: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiles_n", -(-self.n // self.tile_n))
        object.__setattr__(self, "groups", -(-self.tiles_n // self.group_tiles))

    def count(self, seg: int) -> int:
        return rs_row_units(self.ms, self.unit_rows, seg) * self.groups

    def rect(self, seg: int, u: int) -> RsRect:
        lo, hi = rs_unit_rows(self.ms, self.unit_rows, seg, u // self.groups)
        c0 = u % self.groups * self.group_tiles * self.tile_n
        c1 = min(self.n, c0 + self.group_tiles * self.tile_n)
        return RsRect(lo, hi, c0, c1, (lo - seg * self.ms) * self.n + (hi - lo) * c0)

    def piece(self, seg: int, u: int) -> tuple[int, int]:
        """(M-tile, column group) whose GEMM tiles unit u of segment seg waits for."""
        return rs_unit_rows(self.ms, self.unit_rows, seg, u // self.groups)[0] // self.tile_m, u % self.groups


def rs_units(ms: int, unit_rows: int, tile_m: int, n: int, tile_n: Optional[int] = None,
             group_tiles: Optional[int] = None) -> RsUnits:
    """RsUnits, checked; tile_n None: one N-tile (the standalone op); group_tiles None: whole rows."""
    tile_n = n if tile_n is None else tile_n
    if min(ms, unit_rows, tile_m, n, tile_n) < 1 or tile_m % unit_rows:
        raise ValueError(f"bad reduce-scatter units: ms={ms}, unit_rows={unit_rows} (must divide tile_m={tile_m}), "
                         f"n={n}, tile_n={tile_n}")
    tiles_n = -(-n // tile_n)
    gt = tiles_n if group_tiles is None else group_tiles
    if not 1 <= gt <= tiles_n:
        raise ValueError(f"group_tiles={group_tiles} must be 1..{tiles_n} (the N-tiles of n={n})")
    return RsUnits(ms, unit_rows, tile_m, n, tile_n, gt)


def gemm_items(tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int) -> list[tuple[int, int]]:
    """The persistent GEMM's work items in the order its scheduler hands them out, as (cluster row, N-tile): item w
    is in group w // (S * tiles_n) of S cluster rows, walked along N, rows fastest (csrc gemm_scheduler.cuh
    OrderedTileScheduler; cluster c of C takes items c, c + C, ..., so items complete about in this order)."""
    if min(tiles_m, tiles_n, cluster_m) < 1:
        raise ValueError(f"bad GEMM geometry: tiles {tiles_m}x{tiles_n}, cluster_m={cluster_m}")
    rows = -(-tiles_m // cluster_m)
    S = max(1, min(swizzle, rows))
    out = []
    for w in range(rows * tiles_n):
        g, idx = divmod(w, S * tiles_n)
        nrows = min(S, rows - g * S)
        out.append((g * S + idx % nrows, idx // nrows))
    return out


def rs_piece_items(order: Sequence[int], tiles_n: int, cluster_m: int, swizzle: int,
                   group_tiles: int) -> dict[tuple[int, int], int]:
    """For each (M-tile, column group) piece, the index of the last work item (`gemm_items`) that writes one of its
    tiles, for a GEMM with M-tile order table `order`."""
    last: dict[tuple[int, int], int] = {}
    for w, (row, nt) in enumerate(gemm_items(len(order), tiles_n, cluster_m, swizzle)):
        for i in range(row * cluster_m, min(len(order), (row + 1) * cluster_m)):
            last[(order[i], nt // group_tiles)] = w
    return last


def rs_completion(order: Sequence[int], tiles_n: int, cluster_m: int, swizzle: int,
                  group_tiles: int) -> list[tuple[int, int]]:
    """(M-tile, column group) pieces in the order the GEMM (M-tile order table `order`, `swizzle`) completes them:
    by the last work item that writes one of the piece's tiles, ties in order-table position then group."""
    pos = {t: i for i, t in enumerate(order)}
    last = rs_piece_items(order, tiles_n, cluster_m, swizzle, group_tiles)
    return sorted(last, key=lambda p: (last[p], pos[p[0]], p[1]))


COPY, NODE_SUM, FINAL = 0, 1, 2  # csrc/collectives.cu RsOp
RS_OPS = {COPY: "copy", NODE_SUM: "node_sum", FINAL: "final"}


class RsItem(NamedTuple):
    op: int
    seg: int     # segment (= owning PE); COPY: -1
    unit: int    # unit index inside the segment; COPY: copy unit over all M rows


def rs_items(me: int, world: int, node_size: int, m: int, units: RsUnits, copy_rows: int = 0,
             completion: Optional[Sequence[tuple[int, int]]] = None) -> list[tuple[RsItem, int]]:
    """PE `me`'s reduce-scatter work as (item, affinity) in issue order; an item with affinity a >= 0 must run after
    item a of this list in the same thread block. copy_rows > 0: the standalone op, which first copies its
    [copy_rows, N] input into its symmetric addend in units of unit_rows rows. `completion`: the (M-tile, group)
    pieces in the order the GEMM completes them (rs_completion; default: M-tiles in rs_tile_order, whole rows).

      NODE_SUM(s, u)  every segment s with my local index (every node's): sum my node's partials of the unit, in
                      the order the GEMM completes its piece; one node: the result; else the node partial, sent to
                      PE s (kept in my receive slot when s is mine)
      FINAL(s, u)     s = me, several nodes: sum the node partials in node order (after my NODE_SUM of the unit)
    """
    L, nodes, n, l = _topo(me, world, node_size)
    if m <= 0 or m % world or units.ms != m // world:
        raise ValueError(f"m={m} must be a positive multiple of world={world}, with units of {m // world}-row "
                         f"segments (got {units.ms})")
    out: list[tuple[RsItem, int]] = []
    if copy_rows:
        out += [(RsItem(COPY, -1, cu), -1) for cu in range(-(-copy_rows // units.unit_rows))]
    if completion is None:
        completion = rs_completion(rs_tile_order(me, world, node_size, m, units.tile_m), units.tiles_n, 1, 1,
                                   units.group_tiles)
    rank = {p: i for i, p in enumerate(completion)}
    mine = [s for s in sum(rs_segment_phases(me, world, node_size), []) if s % L == l]
    sums = [RsItem(NODE_SUM, s, u) for s in mine for u in range(units.count(s))]
    sums.sort(key=lambda it: (rank[units.piece(it.seg, it.unit)], it.seg, it.unit))
    first = len(out)
    out += [(it, -1) for it in sums]
    if nodes > 1:
        at = {it.unit: first + i for i, it in enumerate(sums) if it.seg == me}
        out += [(RsItem(FINAL, me, u), at[u]) for u in range(units.count(me))]
    return out


def rs_plan(me: int, world: int, node_size: int, m: int, units: RsUnits, blocks: int, copy_rows: int = 0,
            completion: Optional[Sequence[tuple[int, int]]] = None) -> list[list[RsItem]]:
    """The reduce-scatter kernel's work per thread block: items round-robin in issue order, an item with affinity
    on the block of the item it follows (FINAL items come after every NODE_SUM of a block, so no block waits on
    an item behind it)."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    per: list[list[RsItem]] = [[] for _ in range(blocks)]
    block_of: list[int] = []
    rr = 0
    for item, aff in rs_items(me, world, node_size, m, units, copy_rows, completion):
        b = block_of[aff] if aff >= 0 else rr % blocks
        rr += aff < 0
        per[b].append(item)
        block_of.append(b)
    return per


def rs_split_tail(per_block: list[list[RsItem]], completion: Sequence[tuple[int, int]], tail: int, units: RsUnits,
                  tail_blocks: int) -> tuple[list[list[RsItem]], list[list[RsItem]]]:
    """Move the items of the last `tail` pieces of the GEMM's `completion` order out of a reduce plan into a second
    one of `tail_blocks` blocks, which a fused call launches after the GEMM, when every SM is free again: the
    reduction of the GEMM's last wave then runs wide instead of on the few blocks that ran beside the GEMM. Items
    keep their order in either plan (round-robin in the tail)."""
    last = {p: i for i, p in enumerate(completion[len(completion) - tail:])} if tail > 0 else {}
    if not last:
        return per_block, []

    def piece(it: RsItem):
        return units.piece(it.seg, it.unit)
    main = [[it for it in b if it.op == COPY or piece(it) not in last] for b in per_block]
    moved = [it for b in per_block for it in b if it.op != COPY and piece(it) in last]
    moved.sort(key=lambda it: (it.op, last[piece(it)], it.seg, it.unit))  # NODE_SUMs, then FINALs
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
