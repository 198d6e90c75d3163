"""Fast call planning (issue 25): the fused ops' plan for a new M in a few milliseconds of host time.

`simulate.py` (with `search.py`) is the reference model, but it simulates every chunk, tile and reduce unit of
every PE: 0.05 s to seconds per M, too slow for a call that meets a new M (every rank stalls; a CUDA-graph capture
cannot plan at all). The fast model plans from the same model in closed form:

* Buckets of M (`bucket_of`): the decisions (path, engine, comm blocks, GEMM SMs, swizzle, reduce-unit width, tail
  kind) are made once per bucket, at its representative M. Buckets follow tile counts while the GEMM has only a
  few waves (a tile more or less changes its last wave) and are geometric (four per octave) above. What is cheap
  and depends on M itself is made per M: the M-tile order, the tail's piece count, the all-gather's swizzle, and
  in geometric buckets GEMMReduceScatter's split among the bucket's shortlist (`rs_refine`).
* AllGather + GEMM (`fast_ag.plan_ag_gemm`): the arrivals come from one PE's sweep of its comm blocks, every
  other PE doing the same rotated (the ring-shift schedule is symmetric), and the GEMM's makespan with waits from
  a closed form of its static persistent schedule (`gemm_span`, equal to `simulate.run_gemm`'s). At large M the
  sweep merges chunks (a reduced problem: the arrival rate is what the choice needs).
* GEMM + ReduceScatter (`fast_rs.plan_gemm_rs`): pieces complete when the GEMM's closed form says; each PE's
  reduce blocks drain them at `simulate.rs_reduce`'s unit costs, bounded by its NVLink ingress; the tail, which
  PEs start at once, meets the peers' egress queues (`rs_estimates`, numpy over all candidates at once, on the
  tiles that decide at large M).

Where the simulator's link queues (their order of processing, not of start) shape its result, the model follows
them in part: fused times are within a few percent for most splits, and the chosen split's simulated time within
~5% of the simulator's best on the shapes tested (tests/test_plan_fast.py); `call.plan_call_full` still plans
with the simulator itself, for comparison. Everything here is a pure function of its arguments: every PE plans
alike.

This module: the buckets and the persistent GEMM in closed form, shared by fast_ag.py and fast_rs.py.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .search import NoSplit

# ------------------------------------------------------------------------------------------------------------
# Buckets of M
BUCKET_RATIO = 2 ** 0.25   # geometric buckets: four per octave (M within 19% share their decisions)
LINEAR_WAVES = 4           # below this many GEMM waves, buckets also follow the tile count


@dataclasses.dataclass(frozen=True)
class Bucket:
    """M values [lo, hi] (multiples of the world size) planned alike, with the decisions made at M = rep."""

    key: tuple
    lo: int
    hi: int
    rep: int

    @property
    def by_tiles(self) -> bool:
        """Whether every M of the bucket has the same tile count (below `linear_limit`)."""
        return len(self.key) > 1


def linear_limit(tile_m: int, tile_n: int, cluster_m: int, n: int, sms: int) -> int:
    """The M below which the GEMM has fewer than LINEAR_WAVES waves on `sms` SMs (there, buckets follow tiles)."""
    tiles_n = -(-n // tile_n)
    clusters = max(1, sms // cluster_m)
    return max(1, math.ceil(LINEAR_WAVES * clusters / tiles_n)) * cluster_m * tile_m


def bucket_of(m: int, world: int, tile_m: int, linear_m: int) -> Bucket:
    """M's bucket: the multiples of the world size whose rows per PE lie in M's geometric band [r^g, r^(g+1)) of
    BUCKET_RATIO r and, below `linear_m`, whose tile count is M's too."""
    if m < 1 or m % world:
        raise ValueError(f"M = {m} must be a positive multiple of the world size {world}")
    q = m // world
    g = int(math.log(q) / math.log(BUCKET_RATIO))
    while BUCKET_RATIO ** (g + 1) <= q:   # (guard the float log at band edges)
        g += 1
    while g > 0 and BUCKET_RATIO ** g > q:
        g -= 1
    lo, hi = math.ceil(BUCKET_RATIO ** g) * world, (math.ceil(BUCKET_RATIO ** (g + 1)) - 1) * world
    key: tuple = (g,)
    if m < linear_m:
        t = -(-m // tile_m)
        lo = max(lo, -(-((t - 1) * tile_m + 1) // world) * world)
        hi = min(hi, t * tile_m // world * world, (linear_m - 1) // world * world)
        key = (g, t)
    else:
        lo = max(lo, -(-linear_m // world) * world)
    rep = min(hi, max(lo, round(math.sqrt(lo * hi) / world) * world))
    return Bucket(key, lo, hi, rep)


# ------------------------------------------------------------------------------------------------------------
# The persistent GEMM in closed form
def gemm_clusters(tiles_m: int, tiles_n: int, cluster_m: int, sms: int) -> int:
    """Clusters of the persistent grid that get work (`simulate.gemm_work`)."""
    return max(1, min(sms // cluster_m, -(-tiles_m // cluster_m) * tiles_n))


def gemm_span(row_ready, tiles_n: int, cluster_m: int, swizzle: int, sms: int, tile_us: float) -> float:
    """`simulate.run_gemm`'s makespan when cluster row r's A rows are there at row_ready[r]: cluster c walks items
    c, c + C, ..., each taking tile_us after both it and its rows are ready, so it ends at the latest
    ready(item) + (its items from there on) * tile_us, and item w has ceil((items - w) / C) items from it on
    (a row's first item has the most)."""
    rows = len(row_ready)
    items = rows * tiles_n
    c = max(1, min(sms // cluster_m, items))          # clusters that get work (`gemm_clusters`)
    s = max(1, min(swizzle, rows))
    r = np.arange(rows)
    first = r // s * s * tiles_n + r % s             # each row's first item (`schedules.gemm_items`)
    return max(-(-items // c) * tile_us, float((np.asarray(row_ready) + -(-(items - first) // c) * tile_us).max()))


def gemm_plain_us(tiles_m: int, tiles_n: int, cluster_m: int, sms: int, tile_us: float) -> float:
    """The GEMM's time with no waits (`simulate._gemm_us`): whole waves of its clusters."""
    items = -(-tiles_m // cluster_m) * tiles_n
    return -(-items // gemm_clusters(tiles_m, tiles_n, cluster_m, sms)) * tile_us


def pick(candidates: list, us) -> tuple:
    """`search.best` on estimates: the candidate with the smallest `us(candidate)`, the first of those within
    0.5% (candidates listed cheapest first). Returns (candidate, its estimate)."""
    best_c, best_us = None, math.inf
    for c in candidates:
        if us(c) < best_us * 0.995:
            best_c, best_us = c, us(c)
    if best_c is None:
        raise NoSplit("no candidate split fits the SM budget")
    return best_c, best_us
