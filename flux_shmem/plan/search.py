"""The simulator's choice of a fused call's split (engine, comm blocks, GEMM SMs, swizzle, reduce units, tail):
every candidate simulated (simulate.py), the fastest predicted taken. The reference the fast model (fast*.py) is
tested against, and what benchmarks/model.py predicts with."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..kernels.config import swizzle_for
from . import schedules as sch
from .costs import Gemm, Links
from .simulate import Result, _gemm_us, simulate_ag_gemm, simulate_gemm_rs


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
    tail: int = 0           # GEMM+RS: (M-tile, column group) pieces whose reduction runs after the GEMM, on
    tail_blocks: int = 0    # tail_blocks blocks
    group_tiles: int = 0    # GEMM+RS: reduce units' width in N-tiles (0: whole rows)


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
    """AllGatherGEMM's split for M = m: the candidate with the fastest predicted fused time over the GEMMs of
    `pes` (default all). Each swizzle group of the fused GEMM stays inside one chunk's rows. Any PE's tile order
    for the chosen split: `ag_order(r, pe, ...)`."""
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


def ag_order(r: Result, pe: int, m: int, tile_m: int, world: int, chunk_rows: int) -> list[int]:
    """PE `pe`'s M-tile order table for the all-gather arrivals simulated in `r` (simulate_ag_gemm's, whichever
    PEs' GEMMs it ran)."""
    if pe in r.detail["order"]:
        return r.detail["order"][pe]
    return sch.ag_tile_order(m, tile_m, m // world, chunk_rows, r.detail["arrival_us"][pe])


def rs_shapes(tiles_m: int, tiles_n: int, cluster_m: int, clusters: int,
              group_tiles: Optional[int] = None, swizzle: Optional[int] = None) -> list[tuple[int, int]]:
    """(swizzle, group_tiles) pairs GEMMReduceScatter tries: swizzle groups of S cluster rows, reduce units
    `clusters // S` N-tiles wide, so that each wave of the GEMM completes one column group of S cluster rows. S = 1
    gives whole rows (M-tiles complete one after another along N); a wider S spreads what one wave completes over
    S * cluster_m M-tiles (consecutive in the tile order: segments of as many owners), so that the reductions of
    the last wave, the part no overlap hides, are shared by that many PEs."""
    rows = -(-tiles_m // cluster_m)
    if swizzle is not None:  # the swizzle is given (FLUX_SHMEM_GEMM_CONFIG): whole rows or one wave's width
        S = max(1, min(swizzle, rows))
        widths = [group_tiles] if group_tiles is not None else [tiles_n, clusters // S]
        return list(dict.fromkeys((S, max(1, min(tiles_n, w))) for w in widths))
    if group_tiles is not None:  # the width is given: only the swizzle is chosen (whole rows: swizzle 1)
        gt = min(tiles_n, group_tiles)
        return [(1, tiles_n)] if gt == tiles_n else [(S, gt) for S in (1, 2, 4, 8) if S <= rows]
    # (whole rows with S > 1 too: fewer B re-reads than S = 1, SWIZZLE_COST, for a later start of the reductions)
    out = [(1, tiles_n)]
    for S in (2, 4, 8):
        if S <= rows:
            out += list(dict.fromkeys([(S, max(1, min(tiles_n, clusters // S))), (S, tiles_n)]))
    return out


def rs_last_wave(tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int, group_tiles: int, clusters: int) -> int:
    """Pieces (M-tile, column group) whose last tile is in the GEMM's last wave of `clusters` work items."""
    items = -(-tiles_m // cluster_m) * tiles_n
    last = sch.rs_piece_items(range(tiles_m), tiles_n, cluster_m, swizzle, group_tiles)
    return sum(w >= items - clusters for w in last.values())


def plan_gemm_rs(*, world: int, node_size: int, m: int, n: int, k: int, elem_bytes: int, gemm: Gemm,
                 budget_sms: int, unit_rows: int, links: Links = Links(), comm_blocks: Optional[int] = None,
                 decomposed_comm_blocks: Optional[int] = None, group_tiles: Optional[int] = None,
                 swizzle: Optional[int] = None) -> tuple[Split, Result]:
    """GEMMReduceScatter's split for M = m: comm blocks, the GEMM's swizzle and the reduce units' width
    (`rs_shapes`; `group_tiles` given: that width), and a tail: none, the pieces of the GEMM's last wave, or those
    and a cluster row's more (the reductions the comm kernel's few blocks would otherwise do after the GEMM, run
    wide once it ends)."""
    all_sms = budget_sms // gemm.cluster_m * gemm.cluster_m
    cands = split_candidates(("sm",), comm_blocks, budget_sms, gemm.cluster_m, RS_COMM_BLOCKS)
    dec = decomposed_comm_blocks or max([c for _, c in cands] or [RS_COMM_BLOCKS[-1]])
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    tail_blocks = min(all_sms, 64)

    def run(c):
        _, cb, sw, gt, tail = c
        return simulate_gemm_rs(world=world, node_size=node_size, m=m, n=n, k=k, gemm=gemm,
                                gemm_sms=gemm_sms_for(budget_sms, gemm.cluster_m, cb), all_sms=all_sms,
                                comm_blocks=cb, unit_rows=unit_rows, swizzle=sw, group_tiles=gt,
                                elem_bytes=elem_bytes, links=links, decomposed_comm_blocks=dec, tail=tail,
                                tail_blocks=tail_blocks)

    # A lower bound of a candidate's fused time, so that candidates which cannot win are not simulated: its GEMM
    # alone on its SMs and, without a tail, a PE's reductions on the comm blocks, each unit at least its bytes over
    # the model's block rates (reads of every node peer's addend and a write; independent of the units' width).
    L, nodes = node_size, world // node_size
    seg_bytes = nodes * (m // world) * n * elem_bytes  # a PE's NODE_SUM bytes (one addend)
    bl = links.beside()  # the fused reduce runs beside the GEMM
    per_byte = max(1 / (bl.block_gbps * 1e3) if L > 1 else 0.0, (L + 1) / (bl.local_gbps * 1e3))

    def bound(c) -> float:
        _, cb, sw, _, tail = c
        gemm_us = _gemm_us(tiles_m, tiles_n, gemm, sw, gemm_sms_for(budget_sms, gemm.cluster_m, cb))
        return gemm_us if tail else max(gemm_us, seg_bytes * per_byte / cb)

    results: dict[tuple, Result] = {}

    def evaluate(cs) -> None:
        for c in sorted(cs, key=bound):
            if not results or bound(c) < min(r.fused_us for r in results.values()) / 0.995:
                results[c] = run(c)
    # Every (comm blocks, swizzle, width) without a tail first; then tails for the three fastest of those and for
    # the fastest with whole rows (a tail moves the last wave's reductions, which the split without one shows).
    shapes, tails = [], {}
    for e, cb in cands:
        clusters = max(1, gemm_sms_for(budget_sms, gemm.cluster_m, cb) // gemm.cluster_m)
        for sw, gt in rs_shapes(tiles_m, tiles_n, gemm.cluster_m, clusters, group_tiles, swizzle):
            shapes.append((e, cb, sw, gt, 0))
            wave = rs_last_wave(tiles_m, tiles_n, gemm.cluster_m, sw, gt, clusters)
            row = gemm.cluster_m * -(-tiles_n // gt)  # the pieces of one more cluster row
            tails[(e, cb, sw, gt)] = sorted({wave, min(wave + row, tiles_m * -(-tiles_n // gt))} - {0})
    evaluate(shapes)
    ranked = sorted(results, key=lambda c: results[c].fused_us)
    top = set(ranked[:3]) | set([c for c in ranked if c[2] == 1][:1])
    evaluate([c[:4] + (t,) for c in top for t in tails[c[:4]]])
    # Within 0.5% the simpler schedule wins: whole rows one cluster row at a time, then fewer comm blocks, no tail.
    (e, cb, sw, gt, tail), r = best(sorted(results, key=lambda c: (c[2], c[1], c[4])), results.__getitem__)
    return Split(e, cb, gemm_sms_for(budget_sms, gemm.cluster_m, cb), sw, tail, tail_blocks if tail else 0, gt), r
