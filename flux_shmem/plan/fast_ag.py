"""The fast model of AllGather + GEMM (fast.py says how the fast planner works): one PE's sweep of its comm blocks
for the arrivals, the GEMM's makespan with waits in closed form, the split with the fastest estimate."""
from __future__ import annotations

import dataclasses
import heapq
from typing import Optional

import numpy as np

from ..kernels.config import swizzle_for
from . import costs, search
from . import schedules as sch
from . import simulate as S
from .fast import gemm_plain_us, gemm_span, pick

# ------------------------------------------------------------------------------------------------------------
# AllGather + GEMM
@dataclasses.dataclass(frozen=True)
class AgArrivals:
    """When each chunk arrives, seen from any PE: at[dn * L + dl][c] is chunk c of the shard of the PE dn nodes and
    dl local indices further on (0: its own). end: when a PE's comm kernel (or copy stream) is done. sends: PE 0's
    transfers (issued, block, start, duration, egress end, floor, link class, destination, what), if recorded."""

    world: int
    node_size: int
    at: np.ndarray       # [world, chunks]
    end: float
    sends: tuple = ()

    def of(self, pe: int) -> np.ndarray:
        """PE pe's view: arrival times [shard, chunk]."""
        L, N = self.node_size, self.world // self.node_size
        s = np.arange(self.world)
        return self.at[((s // L - pe // L) % N) * L + (s - pe) % L]

    @property
    def last(self) -> float:
        return float(self.at.max())


def ag_arrivals(world: int, node_size: int, rows: int, row_bytes: int, chunk_rows: int, comm_blocks: int,
                links: costs.Links, engine: str = "sm", record: bool = False) -> AgArrivals:
    """`simulate.ag_arrivals` for PE 0, every other PE doing the same rotated (each phase of `schedules.ag_units` is
    a ring shift: each destination receives from one source at a time). Units are walked in issue order; a block
    starts a unit when it is free and the data is there; the PE's NVLink and IB egress links are FIFO queues.
    record: keep PE 0's transfers (for `ag_last_at`)."""
    L, N = node_size, world // node_size
    chunks = -(-rows // chunk_rows)
    nbs = [min(chunk_rows, rows - c * chunk_rows) * row_bytes for c in range(chunks)]
    if engine == "ce":  # one copy stream, in ag_ce_copies' order: my shard, then peer me - i for i = 1, 2, ...
        at = [[0.0] * chunks for _ in range(world)]
        t, local = 0.0, links.ce_local_gbps * 1e3
        for c in range(chunks):
            t = at[0][c] = t + nbs[c] / local
        rate = min(links.ce_gbps, links.nvlink_gbps) * 1e3
        for i in range(1, world):
            row = at[i]
            for c in range(chunks):
                t = row[c] = t + nbs[c] / rate + links.nvlink_latency_us
        return AgArrivals(world, world, np.array(at), t)
    # PE 0's units in issue order (`schedules.ag_units`): (kind, node step j, local step i, chunk); dealt to the
    # blocks round-robin; blocks run in time order (ties: lower block first), as `simulate._run_blocks` runs them.
    units = [(sch.LOCAL, 0, 0, c) for c in range(chunks)]
    units += [(sch.PUT, j, 0, c) for j in range(1, N) for c in range(chunks)]
    units += [(sch.DIRECT, 0, i, c) for i in range(1, L) for c in range(chunks)]
    for j in range(1, N):
        for c in range(chunks):
            units.append((sch.ACCEPT, j, 0, c))
            units += [(sch.FORWARD, j, i, c) for i in range(1, L)]
    at = [[0.0] * chunks for _ in range(world)]
    B = comm_blocks
    nv, ib = links.nvlink_gbps * 1e3, links.ib_gbps * 1e3
    nv_lat, ib_lat, issue = links.nvlink_latency_us, links.ib_latency_us, links.put_issue_us
    blk = links.block_gbps * 1e3
    put_rate = (links.put_block_gbps if links.put_by_blocks else links.block_gbps) * 1e3
    own = rows * row_bytes / (links.ce_local_gbps * 1e3)  # my shard's copy into my gather buffer
    eg = [0.0, 0.0]                                       # egress clocks: NVLink, IB
    known: dict = {}                                      # ('put', j, c): when node n + j's put lands here;
    parked: dict = {}                                     # ('acc', j, c): when I accepted it
    sends: list = []
    nxt = list(range(min(B, len(units))))                 # each block's next unit
    heap = [(0.0, b) for b in range(len(nxt))]
    end = 0.0
    while heap:
        t, b = heapq.heappop(heap)
        u = nxt[b]
        if u >= len(units):
            end = max(end, t)
            continue
        kind, j, i, c = units[u]
        nb = nbs[c]
        if kind == sch.LOCAL:
            done = at[0][c] = max(t, own)
        elif kind == sch.ACCEPT or kind == sch.FORWARD:
            need = ("put", j, c) if kind == sch.ACCEPT else ("acc", j, c)
            if need not in known:
                parked.setdefault(need, []).append((t, b))
                continue
            t = max(t, known[need])
            if kind == sch.ACCEPT:
                done = at[j * L][c] = known[("acc", j, c)] = t + issue
                for tb, pb in parked.pop(("acc", j, c), []):
                    heapq.heappush(heap, (max(tb, done), pb))
            else:
                done = at[j * L + i][c] = _send(eg, 0, t, t, nb, nv, blk, nv_lat, b, L - i, (j, i, c), sends, record)
        elif kind == sch.DIRECT:
            done = at[i][c] = _send(eg, 0, t, max(t, own), nb, nv, blk, nv_lat, b, L - i, (0, i, c), sends, record)
        else:  # PUT: my chunk c is in place (LOCAL units come first), lands as node n + j's put to me
            t = max(t, at[0][c])
            land = known[("put", j, c)] = _send(eg, 1, t, t, nb, ib, put_rate, ib_lat, b, ((N - j) % N) * L,
                                                ("put", j, c), sends, record)
            for tb, pb in parked.pop(("put", j, c), []):
                heapq.heappush(heap, (max(tb, land), pb))
            done = land if links.put_by_blocks else t + issue
        nxt[b] = u + B
        heapq.heappush(heap, (done, b))
    if parked:
        raise RuntimeError(f"all-gather model deadlock: {sorted(parked)[:4]}")
    return AgArrivals(world, L, np.array(at), end, tuple(sends))


def _send(eg: list, cls: int, issued: float, ready: float, nb: float, gbps: float, rate: float, lat: float, b: int,
          dest: int, what, sends: list, record: bool) -> float:
    """A transfer on PE 0's egress link `cls` (a FIFO queue; `simulate._Net.transfer` without the receiver's)."""
    start = ready if ready > eg[cls] else eg[cls]
    e = eg[cls] = start + nb / gbps
    floor = ready + nb / rate
    if record:
        sends.append((issued, b, start, nb / gbps, e, floor, cls, dest, what))
    return (e if e > floor else floor) + lat


def ag_last_at(arr: AgArrivals, d: int, links: costs.Links) -> float:
    """When the last chunk lands at PE d with `simulate._Net`'s receiver queues: a transfer joins its receiver's
    link queue when the simulator processes it (issue time, then sender, then block), not when it starts, so a
    receiver that first hears of a late transfer queues its earlier ones behind it. PE 0 never does (its senders
    issue in ring order); PE 1 does on one node. Senders' clocks are PE 0's (the delays do not feed back, which
    across nodes they do: there `ag_comm_us` asks the simulator where that is cheap)."""
    L, N = arr.node_size, arr.world // arr.node_size
    lat = (links.nvlink_latency_us, links.ib_latency_us)
    dn, dl = d // L, d % L
    incoming = sorted(((e[0], ((dn - e[7] // L) % N) * L + (dl - e[7]) % L, e[1]), e) for e in arr.sends)
    q = [0.0, 0.0]
    last = 0.0
    for _, (issued, b, start, dur, eg_end, floor, cls, dest, what) in incoming:
        q[cls] = max(q[cls], start) + dur
        t = max(eg_end, q[cls], floor) + lat[cls]
        if what[0] == "put":  # accepted by my own block, then forwarded: by the canonical times, or later
            t = max(t + links.put_issue_us, float(arr.at[what[1] * L, what[2]]))
        last = max(last, t)
    return max(last, arr.last)


DECIDE_UNITS = 300    # all-gather units per PE each candidate's sweep walks at most (chunks merged above)
ORDER_UNITS = 600     # ... the sweep of a call's M-tile order, and of the decomposed path's all-gather across nodes
#                       (where the forwards' pipelining needs the finer chunks)
QUEUE_WORK = 1200     # transfers x receivers `ag_last_at` replays at most (beyond: the symmetric view)
SIM_TRANSFERS = 400   # all-gather units of all PEs `ag_comm_us` has the simulator run at most


def model_chunk_rows(world: int, node_size: int, rows: int, chunk_rows: int, max_units: int) -> int:
    """The chunk the model sweeps: the op's, or a power-of-two multiple of it, so that a PE's units (chunks x
    (world + (nodes - 1) x node_size), `schedules.ag_units`) stay within max_units (a reduced problem: what the
    choice needs, at large M, is the rate of the arrivals, not the order of every chunk)."""
    per_chunk = world + (world // node_size - 1) * node_size
    while -(-rows // chunk_rows) * per_chunk > max_units and chunk_rows < rows:
        chunk_rows *= 2
    return chunk_rows


def ag_comm_us(world: int, node_size: int, rows: int, row_bytes: int, chunk_rows: int, blocks: int,
               links: costs.Links) -> float:
    """The all-gather alone (the decomposed path's communication): when its last chunk lands anywhere. On one node
    the receivers' queues of `simulate._Net` are replayed (`ag_last_at`) where that is cheap. Across nodes their
    delays also feed back into the senders: a small problem (a few hundred transfers) is simulated
    (`simulate.ag_arrivals`), a larger one replays the receivers where puts and forwards meet (nodes 0 and 1), and
    a large one, where those delays are small next to the transfers, takes the symmetric view."""
    L, N = node_size, world // node_size
    chunks = -(-rows // chunk_rows)
    if N > 1 and world * chunks * (world + (N - 1) * L) <= SIM_TRANSFERS:
        arr, _ = S.ag_arrivals(world, L, rows, row_bytes, chunk_rows, blocks, links, "sm")
        return max(max(a.values()) for a in arr)
    arr = ag_arrivals(world, L, rows, row_bytes, chunk_rows, blocks, links, "sm", record=True)
    pes = range(world) if N == 1 else sorted({d for d in (1, 2, L - 1, L, L + 1, L + 2) if d < world})
    if len(arr.sends) * len(pes) > QUEUE_WORK:
        return arr.last
    return max(ag_last_at(arr, d, links) for d in pes)


def ag_tile_ready(arr: AgArrivals, pe: int, m: int, tile_m: int, rows: int, chunk_rows: int) -> np.ndarray:
    """When each M-tile's rows are all at PE `pe` (`schedules.tile_chunks`): the latest of the chunks its rows
    span, which are consecutive in (shard, chunk) order."""
    view = arr.of(pe).ravel()
    chunks = arr.at.shape[1]
    lo = np.arange(0, m, tile_m)
    hi = np.minimum(lo + tile_m, m) - 1

    def flat(r):
        return r // rows * chunks + r % rows // chunk_rows
    return np.maximum(np.maximum.reduceat(view, flat(lo)), view[flat(hi)])


def ag_order(arr: AgArrivals, pe: int, m: int, tile_m: int, rows: int, chunk_rows: int) -> list[int]:
    """PE `pe`'s M-tile order table: tiles by when their rows arrive, ties in row order (`schedules.ag_tile_order`)."""
    return np.argsort(ag_tile_ready(arr, pe, m, tile_m, rows, chunk_rows), kind="stable").tolist()


def ag_call_order(world: int, node_size: int, m: int, k: int, elem_bytes: int, tile_m: int, chunk_rows: int,
                  links: costs.Links, engine: str, comm_blocks: int, rank: int) -> list[int]:
    """PE `rank`'s M-tile order for a call with M = m whose all-gather runs on `engine` / `comm_blocks` (the
    model's arrivals beside the GEMM, as `simulate.simulate_ag_gemm` orders tiles)."""
    rows = m // world
    cr = model_chunk_rows(world, node_size, rows, chunk_rows, ORDER_UNITS)
    arr = ag_arrivals(world, node_size, rows, k * elem_bytes, cr, comm_blocks,
                      links.beside() if engine == "sm" else links, engine)
    return ag_order(arr, rank, m, tile_m, rows, cr)


def ag_fused_us(arr: AgArrivals, m: int, n: int, gemm: costs.Gemm, gemm_sms: int, swizzle: int, rows: int,
                chunk_rows: int) -> float:
    """PE 0's fused time: its GEMM walking tiles in arrival order, waiting for their rows, and its comm kernel."""
    ready = ag_tile_ready(arr, 0, m, gemm.tile_m, rows, chunk_rows)
    ready = ready[np.argsort(ready, kind="stable")]
    row_ready = np.maximum.reduceat(ready, np.arange(0, len(ready), gemm.cluster_m))
    tile_us = gemm.tile_us * costs.swizzle_cost(gemm, swizzle, -(-m // gemm.tile_m))
    return max(arr.end, gemm_span(row_ready, -(-n // gemm.tile_n), gemm.cluster_m, swizzle, gemm_sms, tile_us))


def plan_ag_gemm(*, world: int, node_size: int, m: int, n: int, k: int, elem_bytes: int, gemm: costs.Gemm,
                 budget_sms: int, chunk_rows: int, links: costs.Links = costs.Links(), engines=("sm",),
                 comm_blocks: Optional[int] = None,
                 decomposed_comm_blocks: Optional[int] = None) -> tuple[search.Split, S.Result]:
    """`search.plan_ag_gemm` (with pes=[0]) from the closed-form model: the same candidates, the same rule (the
    first within 0.5% of the fastest predicted fused time), candidates whose lower bound cannot win skipped."""
    rows, cm = m // world, gemm.cluster_m
    all_sms = budget_sms // cm * cm
    swz = swizzle_for(gemm, m, chunk_rows, n)[0]
    cands = search.split_candidates(engines, comm_blocks, budget_sms, cm, search.AG_COMM_BLOCKS)
    dec = decomposed_comm_blocks or max([c for e, c in cands if e == "sm"] or [search.AG_COMM_BLOCKS[-1]])
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    nbytes = rows * k * elem_bytes * (world - 1)          # what each PE receives
    fast = gemm.beside_comm(links)
    cr = model_chunk_rows(world, node_size, rows, chunk_rows, DECIDE_UNITS)

    def bound(c) -> float:  # its GEMM alone, and its bytes at the comm's best rate
        e, cb = c
        g = fast if e == "sm" else gemm
        lb = links.beside() if e == "sm" else links
        rate = lb.ce_gbps if e == "ce" else min(cb * lb.block_gbps, lb.nvlink_gbps if node_size > 1 else lb.ib_gbps)
        return max(gemm_plain_us(tiles_m, tiles_n, cm, search.gemm_sms_for(budget_sms, cm, cb), g.tile_us),
                   nbytes / (rate * 1e3))

    fused: dict = {}
    for c in sorted(cands, key=bound):   # (a candidate whose bound is no better than a result cannot win)
        if fused and bound(c) >= min(fused.values()) * 0.995:
            continue
        e, cb = c
        arr = ag_arrivals(world, node_size, rows, k * elem_bytes, cr, cb, links.beside() if e == "sm" else links, e)
        fused[c] = ag_fused_us(arr, m, n, fast if e == "sm" else gemm, search.gemm_sms_for(budget_sms, cm, cb), swz,
                               rows, cr)
    best_c, best_us = pick([c for c in cands if c in fused], fused.__getitem__)
    comm = ag_comm_us(world, node_size, rows, k * elem_bytes, cr if world == node_size else
                      model_chunk_rows(world, node_size, rows, chunk_rows, ORDER_UNITS), dec, links)
    gemm_f = gemm_plain_us(tiles_m, tiles_n, cm, search.gemm_sms_for(budget_sms, cm, best_c[1]),
                           gemm.tile_us * costs.swizzle_cost(gemm, swz, tiles_m))
    gemm_all = gemm_plain_us(tiles_m, tiles_n, cm, all_sms,
                             gemm.tile_us * costs.swizzle_cost(gemm, costs.PLAIN_SWIZZLE, tiles_m))
    r = S.Result("ag_gemm", best_us, comm + gemm_all, comm, gemm_f, gemm_all, [best_us], {"model": "fast"})
    return search.Split(best_c[0], best_c[1], search.gemm_sms_for(budget_sms, cm, best_c[1]), swz), r
