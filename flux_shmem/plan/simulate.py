"""Tile-level simulator of the fused ops (pure Python, no GPU).

It runs the ops' own schedule functions (`schedules.ag_units`, `ag_plan`, `rs_plan`, `ag_tile_order`,
`rs_tile_order`, `ag_ce_copies`) on a model of the machine (costs.py) and predicts when every chunk arrives and
every tile runs, on every PE:

* links: per GPU and direction, NVLink-class (inside a node) and IB-class (between nodes) bandwidth and latency;
  a transfer reserves its sender's egress and its receiver's ingress link for bytes / bandwidth (so many
  transfers share a link in issue order), and one thread block moves at most `block_gbps`;
* communication: the thread blocks of the comm kernel each walk their plan in order, waiting for what an item
  needs (a chunk that arrives from another node, the GEMM tiles a reduction sums); copy engines walk their copy
  list in stream order;
* the GEMM: a persistent grid of clusters, each walking its work tiles as CUTLASS's static persistent scheduler
  hands them out (`gemm_work`: swizzle groups, the M-tile order table), every tile taking `tile_us`; an
  all-gather tile starts once its rows have arrived, a reduce-scatter tile's M-tile counter is complete when all
  its N-tiles are.

Results: fused time (every PE done), decomposed time (communication alone, then the GEMM on all SMs), and the
share of the communication hidden, `(decomposed - fused) / comm` (benchmarks/metrics.overlap_efficiency). The
splits the ops choose with it: search.py.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Callable, Optional, Sequence

from . import schedules as sch
from .costs import PLAIN_SWIZZLE, Gemm, Links, swizzle_cost


# ------------------------------------------------------------------------------------------------------------
def gemm_work(tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int, sm_count: int) -> list[list[tuple[int, int]]]:
    """Per cluster of the launched grid, its work tiles in order as (row, n_tile): the cluster's CTAs take M-tile
    order entries row * cluster_m + i. The mapping of csrc gemm_scheduler.cuh OrderedTileScheduler: cluster c of C
    takes items c, c + C, ... of `schedules.gemm_items`."""
    if min(tiles_m, tiles_n, cluster_m, sm_count) < 1:
        raise ValueError(f"bad GEMM geometry: tiles {tiles_m}x{tiles_n}, cluster_m={cluster_m}, sm_count={sm_count}")
    items = sch.gemm_items(tiles_m, tiles_n, cluster_m, swizzle)
    clusters = max(1, min(sm_count // cluster_m, len(items)))
    return [items[c::clusters] for c in range(clusters)]


def run_gemm(order: list[int], tiles_n: int, g: Gemm, swizzle: int, sm_count: int,
             ready: Optional[Callable[[int], float]] = None, start_us: float = 0.0) -> tuple[list[list[float]], float]:
    """Simulate the persistent GEMM. `order`: the M-tile order table; `ready(m_tile)`: when a tile's A rows are
    there (AG; None: at once). Returns (per M-tile, the end time of each of its N-tiles; the makespan)."""
    tiles_m = len(order)
    ends = [[0.0] * tiles_n for _ in range(tiles_m)]
    makespan = start_us
    tile_us = g.tile_us * swizzle_cost(g, swizzle, tiles_m)
    for items in gemm_work(tiles_m, tiles_n, g.cluster_m, swizzle, sm_count):
        t = start_us
        for row, n in items:
            mts = [order[i] for i in range(row * g.cluster_m, min(tiles_m, (row + 1) * g.cluster_m))]
            if ready is not None:
                t = max([t] + [ready(mt) for mt in mts])
            t += tile_us
            for mt in mts:
                ends[mt][n] = t
        makespan = max(makespan, t)
    return ends, makespan


# ------------------------------------------------------------------------------------------------------------
class _Net:
    """Link clocks of every PE: egress and ingress per link class (0 NVLink, 1 IB)."""

    def __init__(self, world: int, links: Links):
        self.links = links
        self.eg = [[0.0, 0.0] for _ in range(world)]
        self.ing = [[0.0, 0.0] for _ in range(world)]

    def transfer(self, src: int, dst: int, cls: int, nbytes: float, ready: float, rate_gbps: float,
                 initiator: int) -> float:
        """Move nbytes src -> dst, ready at `ready`; returns the time the data is there. The initiating PE's link
        (the sender of a store or put, the reader of a load) is a FIFO queue the transfer waits in; with
        `model_ingress` the other end's link is a second queue the transfer joins when it starts, and it completes
        when both are through (an overloaded receiver slows its senders without idling their links). Without it
        only the initiator's link counts, as link emulation paces (csrc/include/flux_shmem/pace.cuh)."""
        lk = self.links
        dur = nbytes / (lk.gbps(cls) * 1e3)  # GB/s -> bytes per microsecond
        mine, other = (self.eg[src], self.ing[dst]) if initiator == src else (self.ing[dst], self.eg[src])
        start = max(ready, mine[cls])
        mine[cls] = end = start + dur
        if lk.model_ingress:
            other[cls] = max(other[cls], start) + dur
            end = max(end, other[cls])
        return max(end, ready + nbytes / (rate_gbps * 1e3)) + lk.latency(cls)

    def gather(self, reader: int, peers, nbytes: float, ready: float, rate_gbps: float) -> float:
        """`reader` loads nbytes from each of `peers` (but itself) over NVLink, one after another on its link, all
        ready at `ready`: `transfer` for each, inlined (the simulator's hot loop); returns when all are there."""
        lk = self.links
        dur = nbytes / (lk.nvlink_gbps * 1e3)
        ing = self.ing[reader]
        end = floor = ready + nbytes / (rate_gbps * 1e3)
        for q in peers:
            if q == reader:
                continue
            start = ready if ready > ing[0] else ing[0]
            ing[0] = e = start + dur
            if lk.model_ingress:
                eg = self.eg[q]
                eg[0] = (eg[0] if eg[0] > start else start) + dur
                e = e if e > eg[0] else eg[0]
            end = e if e > end else end
        return (end if end > floor else floor) + lk.nvlink_latency_us if len(peers) > 1 else ready


class _Events:
    """Blocks walking item lists; an item may wait on a key that another item sets (parks until then)."""

    def __init__(self):
        self.heap: list[tuple[float, int, int]] = []
        self.known: dict = {}
        self.parked: dict = {}
        self.seq = 0

    def set(self, key, t: float) -> None:
        self.known[key] = t
        for (tb, pe, b) in self.parked.pop(key, []):
            self.push(max(tb, t), pe, b)

    def push(self, t: float, pe: int, b: int) -> None:
        heapq.heappush(self.heap, (t, pe, b))


def _run_blocks(plans: list[list[list]], step: Callable, ev: _Events, start_us: float) -> list[float]:
    """Run every PE's blocks; `step(pe, item, t)` returns (None, key) to wait on key, or (end time, None).
    Returns each PE's end time. Raises if items wait on something no item ever provides (a plan deadlock)."""
    pos = {(pe, b): 0 for pe, blocks in enumerate(plans) for b in range(len(blocks))}
    end = [start_us] * len(plans)
    for (pe, b) in pos:
        ev.push(start_us, pe, b)
    while ev.heap:
        t, pe, b = heapq.heappop(ev.heap)
        items = plans[pe][b]
        i = pos[(pe, b)]
        if i >= len(items):
            end[pe] = max(end[pe], t)
            continue
        done, key = step(pe, items[i], t)
        if done is None:
            if key in ev.known:
                ev.push(max(t, ev.known[key]), pe, b)
            else:
                ev.parked.setdefault(key, []).append((t, pe, b))
            continue
        pos[(pe, b)] = i + 1
        ev.push(done, pe, b)
    if ev.parked:
        stuck = sorted(ev.parked)[:4]
        raise RuntimeError(f"schedule deadlock: items wait forever on {stuck} (a plan needs data nothing sends)")
    return end


@dataclasses.dataclass
class Result:
    op: str
    fused_us: float
    decomposed_us: float
    comm_us: float          # communication alone (every PE's data in place)
    gemm_us: float          # the fused op's GEMM alone, on its SMs, no waits
    gemm_all_us: float      # the GEMM on all SMs (decomposed path)
    per_pe_us: list[float]
    detail: dict

    @property
    def hidden(self) -> float:
        """Share of the communication hidden: (decomposed - fused) / comm."""
        return (self.decomposed_us - self.fused_us) / self.comm_us if self.comm_us > 0 else math.nan

    def as_dict(self) -> dict:
        return {"op": self.op, "fused_us": self.fused_us, "decomposed_us": self.decomposed_us,
                "comm_us": self.comm_us, "gemm_us": self.gemm_us, "gemm_all_us": self.gemm_all_us,
                "hidden": self.hidden}


# ------------------------------------------------------------------------------------------------------------
# AllGather + GEMM
def ag_arrivals(world: int, node_size: int, rows: int, row_bytes: int, chunk_rows: int, comm_blocks: int,
                links: Links = Links(), engine: str = "sm", start_us: float = 0.0
                ) -> tuple[list[dict[tuple[int, int], float]], list[float]]:
    """When chunk (shard, chunk) arrives at every PE, for the all-gather of `rows`-row shards. Returns (per PE
    {(shard, chunk): time}, per PE the time its comm kernel / copy stream is done)."""
    chunks = -(-rows // chunk_rows)
    nbytes = [min(chunk_rows, rows - c * chunk_rows) * row_bytes for c in range(chunks)]
    net = _Net(world, links)
    ev = _Events()
    arr: list[dict] = [dict() for _ in range(world)]
    L = node_size if engine == "sm" else world

    def land(dest: int, key: tuple[int, int], t: float) -> None:
        arr[dest][key] = t
        ev.set((dest, key), t)

    if engine == "ce":
        plans = [[[(cp.dest, cp.chunk, cp.nbytes) for cp in sch.ag_ce_copies(p, world, rows, chunk_rows, row_bytes)]]
                 for p in range(world)]

        def step(pe, item, t):
            dest, c, nb = item
            if dest == pe:
                done = t + nb / (links.ce_local_gbps * 1e3)
            else:
                done = net.transfer(pe, dest, 0, nb, t, links.ce_gbps, pe)
            land(dest, (pe, c), done)
            return done, None
    else:
        plans = [sch.ag_plan(p, world, node_size, chunks, comm_blocks) for p in range(world)]

        own_copy = start_us + rows * row_bytes / (links.ce_local_gbps * 1e3)

        def step(pe, u: sch.AgUnit, t):
            nb = nbytes[u.chunk]
            if u.kind == sch.LOCAL:  # my shard is in place (copy engine); the block raises its flag
                done = max(t, own_copy)
                land(pe, (pe, u.chunk), done)
                return done, None
            if u.kind == sch.ACCEPT:  # the put's landing (recorded at its arrival below), then my flag
                key = ("recv", pe, (u.src, u.chunk))
                if key not in ev.known:
                    return None, key
                done = max(t, ev.known[key]) + links.put_issue_us
                land(pe, (u.src, u.chunk), done)
                return done, None
            need = (pe, (u.src, u.chunk))
            if u.kind == sch.DIRECT:
                t = max(t, own_copy)
            if u.kind in (sch.PUT, sch.FORWARD):  # sent from my gather buffer: the chunk must be here
                if need not in ev.known:
                    return None, need
                t = max(t, ev.known[need])
            cls = int(u.dest // L != pe // L)
            rate = links.put_block_gbps if u.kind == sch.PUT and links.put_by_blocks else links.block_gbps
            at = net.transfer(pe, u.dest, cls, nb, t, rate, pe)
            if u.kind == sch.PUT:  # on the receiver's receive flag: its ACCEPT raises the chunk's
                ev.set(("recv", u.dest, (u.src, u.chunk)), at)
            else:
                land(u.dest, (u.src, u.chunk), at)
            return (t + links.put_issue_us if u.kind == sch.PUT and not links.put_by_blocks else at), None

    ends = _run_blocks(plans, step, ev, start_us)
    return arr, ends


def simulate_ag_gemm(*, world: int, node_size: int, m: int, n: int, k: int, gemm: Gemm, gemm_sms: int,
                     all_sms: int, comm_blocks: int, chunk_rows: int, swizzle: int = 1, elem_bytes: int = 2,
                     links: Links = Links(), engine: str = "sm", order_links: Optional[Links] = None,
                     overhead_us: float = 0.0, pes: Optional[list[int]] = None,
                     decomposed_comm_blocks: Optional[int] = None) -> Result:
    """AllGather+GEMM, out [m, n] per PE from shards [m / world, k]. `order_links`: the link model the op used to
    predict arrivals for its tile order (default: `links`). `pes`: the PEs whose GEMM is simulated (default all;
    the communication always is). detail["order"][pe] is the M-tile order table the op would use. The decomposed
    path's all-gather runs alone, on `decomposed_comm_blocks` blocks (default comm_blocks)."""
    if m % world:
        raise ValueError(f"m={m} must be a multiple of world={world}")
    rows = m // world
    row_bytes = k * elem_bytes
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    # The fused gather runs beside the GEMM, the decomposed one alone (engine 'ce' takes no SMs: no difference).
    fused_links = links.beside() if engine == "sm" else links
    arr, comm_end = ag_arrivals(world, node_size, rows, row_bytes, chunk_rows, comm_blocks, fused_links, engine)
    pred = arr if order_links is None else ag_arrivals(
        world, node_size, rows, row_bytes, chunk_rows, comm_blocks,
        order_links.beside() if engine == "sm" else order_links, engine)[0]
    per_pe, detail = [], {"arrival_us": arr, "tile_end_us": {}, "order": {}}
    for pe in (range(world) if pes is None else pes):
        order = sch.ag_tile_order(m, gemm.tile_m, rows, chunk_rows, pred[pe])
        detail["order"][pe] = order
        need = [sch.tile_chunks(t, gemm.tile_m, m, rows, chunk_rows) for t in range(tiles_m)]
        ready = lambda t, a=arr[pe], nd=need: max(a[sc] for sc in nd[t])  # noqa: E731
        # (the copy engines take no SMs and leave L2 alone but for their own writes: no slowdown measured, none
        # modelled)
        ends, span = run_gemm(order, tiles_n, gemm.beside_comm(links) if engine == "sm" else gemm, swizzle,
                              gemm_sms, ready)
        detail["tile_end_us"][pe] = ends
        per_pe.append(max(span, comm_end[pe]) + overhead_us)
    if engine != "sm" or decomposed_comm_blocks not in (None, comm_blocks) or fused_links is not links:
        # the decomposed path: the SM kernel, alone
        arr = ag_arrivals(world, node_size, rows, row_bytes, chunk_rows, decomposed_comm_blocks or comm_blocks,
                          links, "sm")[0]
    comm = max(max(a.values()) for a in arr)
    gemm_f = _gemm_us(tiles_m, tiles_n, gemm, swizzle, gemm_sms)
    gemm_all = _gemm_us(tiles_m, tiles_n, gemm, PLAIN_SWIZZLE, all_sms)
    return Result("ag_gemm", max(per_pe), comm + gemm_all + 2 * overhead_us, comm, gemm_f, gemm_all, per_pe, detail)


# ------------------------------------------------------------------------------------------------------------
# GEMM + ReduceScatter
def rs_reduce(world: int, node_size: int, m: int, elem_bytes: int, units: sch.RsUnits, comm_blocks: int,
              piece_done: Callable[[int, tuple[int, int]], float], links: Links = Links(), start_us: float = 0.0,
              completions: Optional[Sequence[list[tuple[int, int]]]] = None, tail: int = 0, tail_blocks: int = 0,
              tail_start: Optional[Callable[[int], float]] = None) -> list[float]:
    """The reduce kernels of every PE (`rs_plan` in the order PE p's GEMM completes its pieces, completions[p]
    (None: rs_items' default), its last `tail` pieces split off by `rs_split_tail` onto `tail_blocks` blocks that
    start at tail_start(pe), the end of that PE's GEMM); PE q's GEMM has written the tiles of piece (M-tile,
    column group) at piece_done(q, piece). Returns each PE's end time."""
    L = node_size
    nodes = world // L
    net = _Net(world, links)
    ev = _Events()
    geometry: dict[tuple[int, int], tuple[int, tuple[int, int]]] = {}  # (seg, unit) -> (bytes, piece)

    def steps(block: list[sch.RsItem]) -> list:
        """A block's items as the steps below: (op, seg, unit, bytes, piece)."""
        out = []
        for it in block:
            g = geometry.get((it.seg, it.unit))
            if g is None:
                r = units.rect(it.seg, it.unit)
                g = geometry[(it.seg, it.unit)] = ((r.hi - r.lo) * (r.c1 - r.c0) * elem_bytes,
                                                   units.piece(it.seg, it.unit))
            out.append((it.op, it.seg, it.unit) + g)
        return out

    plans = []
    for p in range(world):
        comp = completions[p] if completions is not None else None
        main = sch.rs_plan(p, world, L, m, units, comm_blocks, completion=comp)
        main, tail_plan = sch.rs_split_tail(main, comp or [], tail, units, max(1, tail_blocks))
        t0 = tail_start(p) if tail_start else start_us
        plans.append([steps(b) for b in main] + [[("start", t0)] + steps(b) for b in tail_plan])
    local = links.local_gbps * 1e3
    lat, unit_us = links.pass_latency_us, links.unit_us

    def floor(nb: int, sources: int) -> float:
        """A unit's latency floor on one block: a pass per 32 KiB of one source, a round of loads per source."""
        return unit_us + -(-nb // 32768) * sources * lat

    def step(pe, it, t):
        if it[0] == "start":  # a tail block: launched after the GEMM
            return max(t, it[1]), None
        op, seg, u, nb, piece = it
        node = pe // L
        if op == sch.NODE_SUM:
            t = max([t] + [piece_done(node * L + q, piece) for q in range(L)])
            done = max(t + max((nb * L + nb) / local, floor(nb, L)),  # L reads and one write by one block
                       net.gather(pe, range(node * L, node * L + L), nb, t, links.block_gbps))
            if nodes > 1:
                if seg // L == node:
                    ev.set(("recv", seg, node, u), done)
                else:  # the node partial goes to the segment's owner
                    at = net.transfer(pe, seg, 1, nb, done,
                                      links.put_block_gbps if links.put_by_blocks else links.block_gbps, pe)
                    ev.set(("recv", seg, node, u), at)
                    done = at if links.put_by_blocks else done + links.put_issue_us
            return done, None
        if op == sch.FINAL:
            for j in range(nodes):
                key = ("recv", pe, j, u)
                if key not in ev.known:
                    return None, key
                t = max(t, ev.known[key])
            return t + max((nodes + 1) * nb / local, floor(nb, nodes)), None
        raise ValueError(f"unexpected reduce-scatter item {it}")

    return _run_blocks(plans, step, ev, start_us)


def simulate_gemm_rs(*, world: int, node_size: int, m: int, n: int, k: int, gemm: Gemm, gemm_sms: int,
                     all_sms: int, comm_blocks: int, unit_rows: int, swizzle: int = 1,
                     group_tiles: Optional[int] = None, elem_bytes: int = 2, links: Links = Links(),
                     overhead_us: float = 0.0, decomposed_comm_blocks: Optional[int] = None, tail: int = 0,
                     tail_blocks: int = 0) -> Result:
    """GEMM+ReduceScatter: partial [m, n] per PE (k is the local K), out [m / world, n]. Reduce units are
    `group_tiles` N-tiles wide (None: whole rows) and wait for those tiles only; the GEMM walks swizzle groups of
    `swizzle` cluster rows. The reductions of the last `tail` (M-tile, group) pieces the GEMM completes run after
    it on `tail_blocks` blocks. The decomposed path's reduce-scatter (whole rows) runs alone, on
    `decomposed_comm_blocks` blocks (default comm_blocks). detail["completion"][pe]: the pieces in completion
    order."""
    if m % world:
        raise ValueError(f"m={m} must be a multiple of world={world}")
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    units = sch.rs_units(m // world, unit_rows, gemm.tile_m, n, gemm.tile_n, group_tiles)
    gt = units.group_tiles
    done, spans, orders, completions = [], [], {}, {}
    by_order: dict[tuple, tuple] = {}  # the PEs of a node share one order: simulate each order once
    for pe in range(world):
        order = orders[pe] = sch.rs_tile_order(pe, world, node_size, m, gemm.tile_m)
        key = tuple(order)
        if key not in by_order:
            e, span = run_gemm(order, tiles_n, gemm.beside_comm(links), swizzle, gemm_sms)
            by_order[key] = ({(t, g): max(e[t][g * gt:(g + 1) * gt]) for t in range(tiles_m)
                              for g in range(units.groups)}, span,
                             sch.rs_completion(order, tiles_n, gemm.cluster_m, swizzle, gt))
        d, span, completions[pe] = by_order[key]
        done.append(d)
        spans.append(span)
    red = rs_reduce(world, node_size, m, elem_bytes, units, comm_blocks, lambda q, p: done[q][p], links.beside(),
                    completions=[completions[q] for q in range(world)], tail=tail, tail_blocks=tail_blocks,
                    tail_start=lambda q: spans[q])
    per_pe = [max(a, b) + overhead_us for a, b in zip(spans, red)]
    comm = _rs_comm_us(world, node_size, m, n, elem_bytes, unit_rows, gemm.tile_m, gemm.tile_n,
                       decomposed_comm_blocks or comm_blocks, links)
    gemm_f = _gemm_us(tiles_m, tiles_n, gemm, swizzle, gemm_sms)
    gemm_all = _gemm_us(tiles_m, tiles_n, gemm, PLAIN_SWIZZLE, all_sms)
    return Result("gemm_rs", max(per_pe), gemm_all + comm + 2 * overhead_us, comm, gemm_f, gemm_all, per_pe,
                  {"reduce_end_us": red, "order": orders, "completion": completions})


@functools.lru_cache(maxsize=256)
def _gemm_us(tiles_m: int, tiles_n: int, gemm: Gemm, swizzle: int, sms: int) -> float:
    """The plain GEMM's time (identity order, no waits): the same for every candidate split a planner tries."""
    return run_gemm(list(range(tiles_m)), tiles_n, gemm, swizzle, sms)[1]


@functools.lru_cache(maxsize=256)
def _rs_comm_us(world: int, node_size: int, m: int, n: int, elem_bytes: int, unit_rows: int, tile_m: int,
                tile_n: int, blocks: int, links: Links) -> float:
    """The reduce-scatter alone (every partial in place, whole rows): the decomposed path's communication."""
    units = sch.rs_units(m // world, unit_rows, tile_m, n, tile_n)
    return max(rs_reduce(world, node_size, m, elem_bytes, units, blocks, lambda q, p: 0.0, links))
