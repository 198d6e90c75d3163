"""Tile-level simulator of the fused ops (pure Python, no GPU).

It runs the ops' own schedule functions (`_schedule.ag_units`, `ag_plan`, `rs_plan`, `ag_tile_order`,
`rs_tile_order`, `ag_ce_copies`) on a model of the machine and predicts when every chunk arrives and every tile
runs, on every PE:

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
share of the communication hidden, `(decomposed - fused) / comm` (benchmarks/metrics.overlap_efficiency).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Optional

from ..kernels.config import swizzle_for
from . import _schedule as sch


@dataclasses.dataclass(frozen=True)
class Links:
    """One GPU's links and engines. Bandwidths in GB/s (1e9 B/s) per direction, latencies in microseconds."""

    nvlink_gbps: float = 360.0       # H100/H200 NVLink 4 as NCCL reaches it (450 nominal)
    ib_gbps: float = 40.0            # one 400 Gb/s NIC per GPU as NVSHMEM reaches it (50 nominal)
    nvlink_latency_us: float = 1.5
    ib_latency_us: float = 5.0
    block_gbps: float = 40.0         # one comm thread block's load/store rate over NVLink (an assumption)
    local_gbps: float = 60.0         # one thread block streaming its own GPU's memory (bytes read + written)
    ce_gbps: float = 300.0           # copy-engine DMA to a peer
    ce_local_gbps: float = 1500.0    # copy-engine DMA inside one GPU (the all-gather's own shard, before its kernel)
    put_issue_us: float = 0.5        # a block's cost of issuing one NVSHMEM put (the data moves without it)
    put_by_blocks: bool = False      # puts go to load/store-mapped peers (forced puts on one node, node groups of
    #                                  one host): NVSHMEM's P2P transport copies with the issuing block's threads,
    #                                  which stay busy for the whole transfer, at put_block_gbps
    put_block_gbps: float = 15.0     # one block's NVSHMEM put to a mapped peer (H200, 2026-12-04: 15.8 GB/s with
    #                                  one block, 14.6 each with two)
    model_ingress: bool = True       # receivers' links are shared too (False: as link emulation paces, senders only)

    def __post_init__(self) -> None:
        for f in ("nvlink_gbps", "ib_gbps", "block_gbps", "local_gbps", "ce_gbps", "put_block_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Links.{f} must be > 0, got {getattr(self, f)!r}")
        for f in ("nvlink_latency_us", "ib_latency_us", "put_issue_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"Links.{f} must be >= 0, got {getattr(self, f)!r}")

    def gbps(self, cls: int) -> float:
        return self.ib_gbps if cls else self.nvlink_gbps

    def latency(self, cls: int) -> float:
        return self.ib_latency_us if cls else self.nvlink_latency_us


def emulated_links(gbps: float, latency_us: float, ib_gbps: Optional[float] = None,
                   ib_latency_us: Optional[float] = None, **kw) -> Links:
    """The links as `FLUX_SHMEM_LINK_GBPS` pacing makes them on one GPU: senders' links only, copies at memory
    speed otherwise."""
    # One 512-thread comm block under MPS, measured on an H200 2026-12-03 (GPU check comm_block_rates, no pacing):
    # 32-38 GB/s for the all-gather's stores into another PE's buffer, 30-32 GB/s for the reduce-scatter's loads
    # of every node PE's addend plus its store.
    kw.setdefault("block_gbps", 35.0)
    kw.setdefault("local_gbps", 32.0)
    return Links(nvlink_gbps=gbps, ib_gbps=ib_gbps if ib_gbps else gbps, nvlink_latency_us=latency_us,
                 ib_latency_us=latency_us if ib_latency_us is None else ib_latency_us, model_ingress=False, **kw)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """The persistent GEMM: tile shape, cluster size along M, and one work tile's time on one SM."""

    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    tile_us: float = 100.0

    @staticmethod
    def from_rate(k: int, tflops_per_sm: float, tile_m: int = 128, tile_n: int = 256, cluster_m: int = 2) -> "Gemm":
        """A tile's time from the K of the problem and one SM's rate (TFLOP/s of the whole GPU / its SMs)."""
        return Gemm(tile_m, tile_n, cluster_m, 2.0 * tile_m * tile_n * k / (tflops_per_sm * 1e12) * 1e6)


# ------------------------------------------------------------------------------------------------------------
def gemm_work(tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int, sm_count: int) -> list[list[tuple[int, int]]]:
    """Per cluster of the launched grid, its work tiles in order as (row, n_tile): the cluster's CTAs take M-tile
    order entries row * cluster_m + i. The mapping of csrc gemm_ext.cuh OrderedTileScheduler: cluster c of C
    takes items c, c + C, ...; item w is in group w // (S * tiles_n) of S cluster rows, walked along N."""
    if min(tiles_m, tiles_n, cluster_m, sm_count) < 1:
        raise ValueError(f"bad GEMM geometry: tiles {tiles_m}x{tiles_n}, cluster_m={cluster_m}, sm_count={sm_count}")
    rows = -(-tiles_m // cluster_m)
    items = rows * tiles_n
    clusters = max(1, min(sm_count // cluster_m, items))
    S = max(1, min(swizzle, rows))
    work: list[list[tuple[int, int]]] = [[] for _ in range(clusters)]
    for w in range(items):
        g, idx = divmod(w, S * tiles_n)
        nrows = min(S, rows - g * S)
        work[w % clusters].append((g * S + idx % nrows, idx // nrows))
    return work


def run_gemm(order: list[int], tiles_n: int, g: Gemm, swizzle: int, sm_count: int,
             ready: Optional[Callable[[int], float]] = None, start_us: float = 0.0) -> tuple[list[list[float]], float]:
    """Simulate the persistent GEMM. `order`: the M-tile order table; `ready(m_tile)`: when a tile's A rows are
    there (AG; None: at once). Returns (per M-tile, the end time of each of its N-tiles; the makespan)."""
    tiles_m = len(order)
    ends = [[0.0] * tiles_n for _ in range(tiles_m)]
    makespan = start_us
    for items in gemm_work(tiles_m, tiles_n, g.cluster_m, swizzle, sm_count):
        t = start_us
        for row, n in items:
            mts = [order[i] for i in range(row * g.cluster_m, min(tiles_m, (row + 1) * g.cluster_m))]
            if ready is not None:
                t = max([t] + [ready(mt) for mt in mts])
            t += g.tile_us
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
    arr, comm_end = ag_arrivals(world, node_size, rows, row_bytes, chunk_rows, comm_blocks, links, engine)
    pred = arr if order_links is None else ag_arrivals(world, node_size, rows, row_bytes, chunk_rows, comm_blocks,
                                                        order_links, engine)[0]
    per_pe, detail = [], {"arrival_us": arr, "tile_end_us": {}, "order": {}}
    for pe in (range(world) if pes is None else pes):
        order = sch.ag_tile_order(m, gemm.tile_m, rows, chunk_rows, pred[pe])
        detail["order"][pe] = order
        need = [sch.tile_chunks(t, gemm.tile_m, m, rows, chunk_rows) for t in range(tiles_m)]
        ready = lambda t, a=arr[pe], nd=need: max(a[sc] for sc in nd[t])  # noqa: E731
        ends, span = run_gemm(order, tiles_n, gemm, swizzle, gemm_sms, ready)
        detail["tile_end_us"][pe] = ends
        per_pe.append(max(span, comm_end[pe]) + overhead_us)
    if engine != "sm" or decomposed_comm_blocks not in (None, comm_blocks):  # the decomposed path: SM kernel
        arr = ag_arrivals(world, node_size, rows, row_bytes, chunk_rows, decomposed_comm_blocks or comm_blocks,
                          links, "sm")[0]
    comm = max(max(a.values()) for a in arr)
    ident = list(range(tiles_m))
    _, gemm_f = run_gemm(ident, tiles_n, gemm, swizzle, gemm_sms)
    _, gemm_all = run_gemm(ident, tiles_n, gemm, swizzle, all_sms)
    return Result("ag_gemm", max(per_pe), comm + gemm_all + 2 * overhead_us, comm, gemm_f, gemm_all, per_pe, detail)


# ------------------------------------------------------------------------------------------------------------
# GEMM + ReduceScatter
def rs_reduce(world: int, node_size: int, m: int, n: int, elem_bytes: int, unit_rows: int, tile_m: int,
              comm_blocks: int, counter_ready: Callable[[int, int], float], links: Links = Links(),
              start_us: float = 0.0, tail_tiles: int = 0, tail_blocks: int = 0,
              tail_start: Optional[Callable[[int], float]] = None) -> list[float]:
    """The reduce kernels of every PE (`rs_plan`, its tail split off by `rs_split_tail` onto `tail_blocks` blocks
    that start at tail_start(pe), the end of that PE's GEMM), M-tile counters complete at counter_ready(pe,
    m_tile). Returns each PE's end time."""
    L = node_size
    nodes = world // L
    ms = m // world
    row = n * elem_bytes
    net = _Net(world, links)
    ev = _Events()
    plans = []
    for p in range(world):
        main, tail = sch.rs_split_tail(sch.rs_plan(p, world, L, m, unit_rows, tile_m, comm_blocks),
                                       sch.rs_tile_order(p, world, L, m, tile_m), tail_tiles, ms, unit_rows,
                                       tile_m, max(1, tail_blocks))
        t0 = tail_start(p) if tail_start else start_us
        plans.append(main + [[("start", t0)] + b for b in tail])
    local = links.local_gbps * 1e3

    def step(pe, it, t):
        if it[0] == "start":  # a tail block: launched after the GEMM
            return max(t, it[1]), None
        lo, hi = sch.rs_unit_rows(ms, unit_rows, it.seg, it.unit)
        nb = (hi - lo) * row
        tile = lo // tile_m
        node = pe // L
        peers = [node * L + q for q in range(L)]
        if it.op == sch.NODE_SUM:
            t = max([t] + [counter_ready(q, tile) for q in peers])
            done = t
            for q in peers:
                if q != pe:
                    done = max(done, net.transfer(q, pe, 0, nb, t, links.block_gbps, pe))
            done = max(done, t + (nb * L + nb) / local)  # L reads and one write by one block
            if nodes > 1:
                if it.seg // L == node:
                    ev.set(("recv", it.seg, node, it.unit), done)
                else:  # the node partial goes to the segment's owner
                    at = net.transfer(pe, it.seg, 1, nb, done,
                                      links.put_block_gbps if links.put_by_blocks else links.block_gbps, pe)
                    ev.set(("recv", it.seg, node, it.unit), at)
                    done = at if links.put_by_blocks else done + links.put_issue_us
            return done, None
        if it.op == sch.FINAL:
            for j in range(nodes):
                key = ("recv", pe, j, it.unit)
                if key not in ev.known:
                    return None, key
                t = max(t, ev.known[key])
            return t + (nodes + 1) * nb / local, None
        raise ValueError(f"unexpected reduce-scatter item {it}")

    return _run_blocks(plans, step, ev, start_us)


def simulate_gemm_rs(*, world: int, node_size: int, m: int, n: int, k: int, gemm: Gemm, gemm_sms: int,
                     all_sms: int, comm_blocks: int, unit_rows: int, swizzle: int = 1, elem_bytes: int = 2,
                     links: Links = Links(), overhead_us: float = 0.0,
                     decomposed_comm_blocks: Optional[int] = None, tail_tiles: int = 0,
                     tail_blocks: int = 0) -> Result:
    """GEMM+ReduceScatter: partial [m, n] per PE (k is the local K), out [m / world, n]. The reductions of the
    last `tail_tiles` M-tiles run after the GEMM on `tail_blocks` blocks. The decomposed path's reduce-scatter runs
    alone, on `decomposed_comm_blocks` blocks (default comm_blocks)."""
    if m % world:
        raise ValueError(f"m={m} must be a multiple of world={world}")
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    ends = []
    spans = []
    orders = {}
    for pe in range(world):
        order = orders[pe] = sch.rs_tile_order(pe, world, node_size, m, gemm.tile_m)
        e, span = run_gemm(order, tiles_n, gemm, swizzle, gemm_sms)
        ends.append([max(row) for row in e])
        spans.append(span)
    red = rs_reduce(world, node_size, m, n, elem_bytes, unit_rows, gemm.tile_m, comm_blocks,
                    lambda q, t: ends[q][t], links, tail_tiles=tail_tiles, tail_blocks=tail_blocks,
                    tail_start=lambda q: spans[q])
    per_pe = [max(a, b) + overhead_us for a, b in zip(spans, red)]
    comm = max(rs_reduce(world, node_size, m, n, elem_bytes, unit_rows, gemm.tile_m,
                         decomposed_comm_blocks or comm_blocks, lambda q, t: 0.0, links))
    ident = list(range(tiles_m))
    _, gemm_f = run_gemm(ident, tiles_n, gemm, swizzle, gemm_sms)
    _, gemm_all = run_gemm(ident, tiles_n, gemm, swizzle, all_sms)
    return Result("gemm_rs", max(per_pe), gemm_all + comm + 2 * overhead_us, comm, gemm_f, gemm_all, per_pe,
                  {"m_tile_done_us": ends, "reduce_end_us": red, "order": orders})


class NoSplit(ValueError):
    """No candidate split fits the SM budget."""


def best(candidates: list, run: Callable) -> tuple:
    """The candidate whose `run(candidate)` Result has the smallest fused time (the first of those within 0.5%:
    list the cheaper candidates first). Returns (candidate, result)."""
    best_c, best_r = None, None
    for c in candidates:
        r = run(c)
        if best_r is None or r.fused_us < best_r.fused_us * 0.995:
            best_c, best_r = c, r
    if best_r is None:
        raise NoSplit("no candidate split fits the SM budget")
    return best_c, best_r


# ------------------------------------------------------------------------------------------------------------
# The choices the fused ops make with the simulator (also what benchmarks/model.py predicts)
AG_COMM_BLOCKS = (1, 2, 4, 8, 16)  # SM-engine all-gather sizes tried
RS_COMM_BLOCKS = (2, 4, 8, 16, 24)  # reduce-scatter sizes tried


@dataclasses.dataclass(frozen=True)
class Split:
    """How a fused call uses the SM budget: its communication engine and blocks, the GEMM's CTAs, its swizzle."""

    engine: str
    comm_blocks: int
    gemm_sms: int
    swizzle: int
    tail_tiles: int = 0     # GEMM+RS: M-tiles whose reduction runs after the GEMM, on tail_blocks blocks
    tail_blocks: int = 0


def gemm_sms_for(budget_sms: int, cluster_m: int, comm_blocks: int) -> int:
    """GEMM CTAs beside a comm kernel of `comm_blocks` blocks, both inside the budget at once (a GEMM CTA fills an
    SM's registers and shared memory, so a comm block never shares its SM). The comm kernel runs in clusters of
    the GEMM's cluster size (AllGather.launch(cluster=)), so it takes whole cluster slots."""
    comm_slots = -(-comm_blocks // cluster_m) * cluster_m
    return (budget_sms - comm_slots) // cluster_m * cluster_m


def split_candidates(engines, comm_blocks: Optional[int], budget_sms: int, cluster_m: int,
                     pool: tuple[int, ...]) -> list[tuple[str, int]]:
    """(engine, comm blocks) to try, cheapest first: the copy engines leave one SM to their barrier kernel; the
    SM engine takes `comm_blocks` (given) or each of `pool` that leaves at least half the budget to the GEMM."""
    out = [("ce", 1)] if "ce" in engines else []
    if "sm" in engines:
        if comm_blocks is not None:
            out.append(("sm", comm_blocks))
        else:
            fit = [c for c in pool if c + cluster_m <= budget_sms // 2]
            out += [("sm", c) for c in (fit or [max(1, min(pool[0], budget_sms - cluster_m))])]
    return [(e, c) for e, c in out if gemm_sms_for(budget_sms, cluster_m, c) >= cluster_m]


def ag_engines(one_domain: bool, emulated: bool, world: int) -> tuple[str, ...]:
    """The all-gather engines AllGatherGEMM(engine='auto') chooses from: the copy engines only inside one NVLink
    domain, with something to send, and unpaced (link emulation cannot pace them)."""
    return ("ce", "sm") if one_domain and not emulated and world > 1 else ("sm",)


def plan_ag_gemm(*, world: int, node_size: int, m: int, n: int, k: int, elem_bytes: int, gemm: Gemm,
                 budget_sms: int, chunk_rows: int, links: Links = Links(), engines=("sm",),
                 comm_blocks: Optional[int] = None, decomposed_comm_blocks: Optional[int] = None,
                 pes: Optional[list[int]] = None) -> tuple[Split, Result]:
    """AllGatherGEMM's split for M = m: the candidate with the fastest predicted fused time. Each swizzle group of
    the fused GEMM stays inside one chunk's rows."""
    all_sms = budget_sms // gemm.cluster_m * gemm.cluster_m
    swz = swizzle_for(gemm, m, chunk_rows, n)[0]  # (only tile_m and cluster_m of the configuration matter)
    cands = split_candidates(engines, comm_blocks, budget_sms, gemm.cluster_m, AG_COMM_BLOCKS)
    dec = decomposed_comm_blocks or max([c for e, c in cands if e == "sm"] or [AG_COMM_BLOCKS[-1]])

    def run(c):
        return simulate_ag_gemm(world=world, node_size=node_size, m=m, n=n, k=k, gemm=gemm,
                                gemm_sms=gemm_sms_for(budget_sms, gemm.cluster_m, c[1]), all_sms=all_sms,
                                comm_blocks=c[1], chunk_rows=chunk_rows, swizzle=swz, elem_bytes=elem_bytes,
                                links=links, engine=c[0], pes=pes, decomposed_comm_blocks=dec)
    (e, cb), r = best(cands, run)
    return Split(e, cb, gemm_sms_for(budget_sms, gemm.cluster_m, cb), swz), r


def plan_gemm_rs(*, world: int, node_size: int, m: int, n: int, k: int, elem_bytes: int, gemm: Gemm,
                 budget_sms: int, unit_rows: int, links: Links = Links(), comm_blocks: Optional[int] = None,
                 decomposed_comm_blocks: Optional[int] = None) -> tuple[Split, Result]:
    """GEMMReduceScatter's split for M = m. The fused GEMM walks one cluster row at a time along N (swizzle 1):
    M-tiles then complete one after another, steadily, instead of a swizzle group's worth at once (which would
    leave the last group's reduction after the GEMM)."""
    all_sms = budget_sms // gemm.cluster_m * gemm.cluster_m
    cands = split_candidates(("sm",), comm_blocks, budget_sms, gemm.cluster_m, RS_COMM_BLOCKS)
    dec = decomposed_comm_blocks or max([c for _, c in cands] or [RS_COMM_BLOCKS[-1]])
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    tail_blocks = min(all_sms, 64)

    def tail_for(cb: int) -> int:
        """The M-tiles the GEMM's last wave completes (plus a cluster row), whose reduction would otherwise run
        on the comm kernel's few blocks after the GEMM."""
        clusters = max(1, gemm_sms_for(budget_sms, gemm.cluster_m, cb) // gemm.cluster_m)
        return min(tiles_m, (-(-clusters // tiles_n) + 1) * gemm.cluster_m)

    def run(c):
        return simulate_gemm_rs(world=world, node_size=node_size, m=m, n=n, k=k, gemm=gemm,
                                gemm_sms=gemm_sms_for(budget_sms, gemm.cluster_m, c[1]), all_sms=all_sms,
                                comm_blocks=c[1], unit_rows=unit_rows, swizzle=1, elem_bytes=elem_bytes,
                                links=links, decomposed_comm_blocks=dec, tail_tiles=c[2], tail_blocks=tail_blocks)
    def tails(cb: int) -> list[int]:
        """None, the last wave's M-tiles plus a cluster row, and without that row (W = 8, Llama-3-70B down:
        785.7 us against 793.8; the spare row's reduction then runs beside the last wave instead)."""
        top = tail_for(cb)
        return sorted({0, max(0, top - gemm.cluster_m), top})
    (e, cb, tail), r = best([(e, cb, t) for e, cb in cands for t in tails(cb)], run)
    return Split(e, cb, gemm_sms_for(budget_sms, gemm.cluster_m, cb), 1, tail, tail_blocks if tail else 0), r
