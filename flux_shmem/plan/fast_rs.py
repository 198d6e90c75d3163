"""The fast model of GEMM + ReduceScatter (fast.py says how the fast planner works): pieces complete when the
GEMM's closed form says, each PE's reduce blocks drain them at the simulator's unit costs; every candidate split
estimated at once (numpy), the fastest taken; per M, the bucket's shortlist re-estimated (`rs_refine`)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np

from . import costs, search
from . import simulate as S
from .fast import gemm_clusters, gemm_plain_us, pick

# ------------------------------------------------------------------------------------------------------------
# GEMM + ReduceScatter
@dataclasses.dataclass(frozen=True)
class RsGeometry:
    """What a GEMM+RS call with M = m reduces, seen from node 0 (the other nodes do the same, rotated): its GEMM's
    M-tile order (`schedules.rs_tile_order`, common to a node's PEs) and one entry per (M-tile, segment) of the
    rows the segment's node-0 reducer sums: local index, rows, row units, whether the segment is node 0's own."""

    world: int
    node_size: int
    m: int
    n: int
    elem_bytes: int
    unit_rows: int
    tile_m: int
    tile_n: int
    pos: np.ndarray      # per M-tile, its position in the order table
    tile: np.ndarray     # per entry: M-tile, local index of its reducer, rows, units, own segment (0/1)
    owner: np.ndarray
    rows: np.ndarray
    units: np.ndarray
    own: np.ndarray
    by_owner: np.ndarray  # entries by reducer (stable)
    early: Optional[np.ndarray] = None  # a reduced geometry (`reduced`): entries before the dropped middle, and
    middle: Optional[np.ndarray] = None  # per reducer the middle's row units, rows, own units, remote units / rows

    @staticmethod
    def of(world: int, node_size: int, m: int, n: int, elem_bytes: int, unit_rows: int, tile_m: int,
           tile_n: int) -> "RsGeometry":
        ms, L = m // world, node_size
        tiles_m = -(-m // tile_m)
        lo, hi, tile, seg = _cuts(m, world, tile_m)   # entries: one per (tile, segment)
        units = -(-hi // unit_rows) - lo // unit_rows
        node = seg // L
        pos = np.empty(tiles_m, dtype=np.int64)
        pos[_rs_order(0, world, L, tile_m, ms, lo, tile, seg)] = np.arange(tiles_m)
        return RsGeometry(world, L, m, n, elem_bytes, unit_rows, tile_m, tile_n, pos, tile, seg % L, hi - lo, units,
                          (node == 0).astype(np.int64), np.argsort(seg % L, kind="stable"))

    @functools.cached_property
    def first_of_tile(self) -> np.ndarray:
        """Per entry, whether it is its M-tile's first (`rs_estimates`: a piece's distinct keys)."""
        first = np.zeros(len(self.tile), dtype=bool)
        first[np.unique(self.tile, return_index=True)[1]] = True
        first.setflags(write=False)
        return first

    @property
    def order(self) -> list[int]:
        """Node 0's M-tile order table."""
        return np.argsort(self.pos).tolist()

    def reduced(self, head: int, tail: int) -> "RsGeometry":
        """This geometry without the entries of the tiles at order positions [head, tiles - tail) (a reduced
        problem: a reducer's end is set by its first pieces, when it cannot keep up, or by the last few waves),
        their totals kept per reducer for the work that follows the first pieces. head and tail: multiples of
        16 tiles (8 cluster rows of 2, the widest swizzle group), so the middle completes between the two."""
        p = self.pos[self.tile]
        keep, early = (p < head) | (p >= len(self.pos) - tail), p < head
        if keep.all():
            return self
        mid = ~keep
        L = self.node_size
        several = self.world > L  # final sums and puts: several nodes only
        own = self.own if several else np.zeros_like(self.own)
        remote = 1 - self.own if several else np.zeros_like(self.own)
        middle = np.stack([np.bincount(self.owner[mid], weights=x[mid], minlength=L)
                           for x in (self.units, self.rows, self.units * own, self.units * remote, self.rows * remote)])
        sub = {f: getattr(self, f)[keep] for f in ("tile", "owner", "rows", "units", "own")}
        return dataclasses.replace(self, **sub, by_owner=np.argsort(sub["owner"], kind="stable"),
                                   early=early[keep], middle=middle)


def _cuts(m: int, world: int, tile_m: int) -> tuple:
    """The pieces of [0, m) between tile and segment boundaries: (their first rows, last rows + 1, tiles, segments)."""
    ms = m // world
    cuts = np.sort(np.r_[np.arange(0, m, tile_m), np.arange(0, m, ms), m])   # (np.union1d: numpy.ma's import)
    cuts = cuts[np.r_[True, cuts[1:] != cuts[:-1]]]
    lo, hi = cuts[:-1], cuts[1:]
    return lo, hi, lo // tile_m, lo // ms


def _rs_order(pe: int, world: int, node_size: int, tile_m: int, ms: int, lo, tile, seg) -> np.ndarray:
    """`schedules.rs_tile_order` from the tile/segment pieces: tiles by the latest (phase, tile within the segment,
    index in the phase) of their segments, then by tile."""
    L, N = node_size, world // node_size
    j = (seg // L - pe // L) % N                                   # nodes after mine (0: my own)
    phase, index = (j == 0).astype(np.int64), np.where(j == 0, seg % L, (j - 1) * L + seg % L)
    key = (phase * (int(tile[-1]) + 2) + (lo - seg * ms) // tile_m) * world + index
    starts = np.flatnonzero(np.r_[True, tile[1:] != tile[:-1]])
    return np.argsort(np.maximum.reduceat(key, starts), kind="stable")


def rs_tile_order(pe: int, world: int, node_size: int, m: int, tile_m: int) -> list[int]:
    """`schedules.rs_tile_order`, vectorized (a call's order at large M in well under a millisecond)."""
    if m <= 0 or tile_m <= 0 or m % world:
        raise ValueError(f"m={m} must be a positive multiple of world={world}; tile_m={tile_m} positive")
    lo, _, tile, seg = _cuts(m, world, tile_m)
    return _rs_order(pe, world, node_size, tile_m, m // world, lo, tile, seg).tolist()


def _unit_us(nb, sources: int, lk: costs.Links):
    """One reduce unit of nb bytes per source on one block (`simulate.rs_reduce`: its local traffic or its latency
    floor); nb an int or an array."""
    mx = max if isinstance(nb, int) else np.maximum
    return mx((sources + 1) * nb / (lk.local_gbps * 1e3), lk.unit_us + -(-nb // 32768) * sources * lk.pass_latency_us)


def _node_sum_us(nb, node_size: int, lk: costs.Links):
    """A node sum's unit: `_unit_us` of node_size sources, and with peers its loads at one block's rate."""
    d = _unit_us(nb, node_size, lk)
    if node_size == 1:
        return d
    mx = max if isinstance(nb, int) else np.maximum
    return mx(d, nb / (lk.block_gbps * 1e3) + lk.nvlink_latency_us)


@dataclasses.dataclass(frozen=True)
class RsSplit:
    """A GEMM+RS candidate for `rs_estimates`: the GEMM's SMs and swizzle, the reduce kernel's blocks, the units'
    width in N-tiles, the tail's pieces."""

    gemm_sms: int
    comm_blocks: int
    swizzle: int
    group_tiles: int
    tail: int = 0


def rs_estimates(geo: RsGeometry, gemm: costs.Gemm, splits: Sequence[RsSplit], tail_blocks: int,
                 links: costs.Links) -> np.ndarray:
    """`simulate.simulate_gemm_rs`'s fused time of each split, in closed form, all splits at once (numpy over one
    flat array of slots: per split and reducer, its (entry, column group) pieces, latest completion first).
    `gemm` and `links` as they run beside each other (`Gemm.beside_comm`, `Links.beside`).

    A piece (M-tile, column group) completes with the work item of its row that holds the group's last N-tile
    (`schedules.gemm_items`), at the end of that item's wave. A reducer's comm blocks take its units in completion
    order (`schedules.rs_completion`), so it ends at the latest (piece done + the time its work from that piece on
    takes: its units round-robin on the blocks at `_node_sum_us` each, or their loads on its NVLink ingress). Its
    final sums (several nodes) follow its node sums and wait for the last node partial over IB (the other nodes'
    puts of its segment, rotated: its own puts). The last `tail` pieces start when the GEMM ends, on tail_blocks
    blocks, with the burst of `simulate._Net.gather`'s queues that PEs starting at once meet, while every PE's
    tail loads also pass each peer's egress link."""
    L, N, eb, lk = geo.node_size, geo.world // geo.node_size, geo.elem_bytes, links
    cm, tn = gemm.cluster_m, -(-geo.n // geo.tile_n)
    tiles_m = len(geo.pos)
    rows_c = -(-tiles_m // cm)
    K, ne = len(splits), len(geo.tile)
    # per split: clusters, swizzle, width in N-tiles, blocks, tile time, column groups
    C, sw, gt, cb = np.array([(gemm_clusters(tiles_m, tn, cm, sp.gemm_sms), max(1, min(sp.swizzle, rows_c)),
                               sp.group_tiles, sp.comm_blocks) for sp in splits]).T
    cb = cb.astype(float)
    tu = np.array([gemm.tile_us * costs.swizzle_cost(gemm, sp.swizzle, tiles_m) for sp in splits])
    groups = -(-tn // gt)
    gmax = int(groups.max())
    G = np.arange(gmax)
    valid = G < groups[:, None]                                                     # [split, group]
    width = np.where(valid, np.minimum((G + 1) * gt[:, None] * geo.tile_n, geo.n) - G * gt[:, None] * geo.tile_n, 0)
    nb = geo.unit_rows * width * eb
    d_ns, d_fin = _node_sum_us(nb, L, lk), _unit_us(nb, N, lk)                      # [split, group]
    # the slots: per split, every entry's groups (entry-major, as a reducer takes a piece's groups)
    per_split = ne * groups
    sk = np.repeat(np.arange(K), per_split)
    local = np.arange(len(sk)) - np.repeat(np.cumsum(per_split) - per_split, per_split)
    e, g = np.divmod(local, groups[sk])
    pos = geo.pos[geo.tile][e]
    r = pos // cm
    s_ = sw[sk]
    gi = r // s_
    w = gi * s_ * tn + r - gi * s_ + (np.minimum((g + 1) * gt[sk], tn) - 1) * np.minimum(s_, rows_c - gi * s_)
    key = (w * tiles_m + pos) * gmax + g                                            # rs_completion's order
    big = int(key.max()) + 1
    seg = sk * L + geo.owner[e]                                                     # (split, reducer)
    # in each (split, reducer) segment its slots latest first, so that a sum from a slot to the reducer's end is
    # a running sum (the ascending stable order reversed, segments included)
    perm = np.argsort(seg * big + key, kind="stable")[::-1]
    sk, e, g, w, key, seg = sk[perm], e[perm], g[perm], w[perm], key[perm], seg[perm]
    counts = np.bincount(seg, minlength=K * L)[::-1]                                # slots per segment, as laid
    starts = np.cumsum(counts) - counts

    def seg_sum(x):
        return np.add.reduceat(x, starts, axis=-1)[..., ::-1].reshape(x.shape[:-1] + (K, L))

    def seg_max(x):
        return np.maximum.reduceat(x, starts, axis=-1)[..., ::-1].reshape(x.shape[:-1] + (K, L))

    def running(x):  # per slot, its segment's sum of x from the slot's piece on (in completion order)
        cs = np.cumsum(x, axis=-1)
        return cs - np.repeat(cs[..., starts] - x[..., starts], counts, axis=-1)

    units = geo.units[e].astype(float)
    loads = geo.rows[e] * width[sk, g] * eb
    remote = (1 - geo.own[e]) if N > 1 else None
    v = np.empty((7 if N > 1 else 4, len(sk)))
    np.multiply(w // C[sk] + 1, tu[sk], out=v[0])       # the piece's completion
    v[1] = units
    np.multiply(units, d_ns[sk, g] + lk.put_issue_us * remote if N > 1 else d_ns[sk, g], out=v[2])
    np.multiply(loads, (L - 1) / (lk.nvlink_gbps * 1e3), out=v[3])
    if N > 1:   # final sums' units and time, the IB link's time
        np.multiply(units, geo.own[e], out=v[4])
        np.multiply(v[4], d_fin[sk, g], out=v[5])
        np.multiply(loads, remote / (lk.ib_gbps * 1e3), out=v[6])
    tails = [i for i, sp in enumerate(splits) if sp.tail]
    main = None
    if tails:  # the last `tail` pieces of the completion order: keys from the tail-th largest distinct one on
        want = np.zeros(K, dtype=np.int64)
        want[tails] = [splits[i].tail for i in tails]
        # (a piece's keys: one per entry of its M-tile; those of the tile's first entry alone are distinct)
        pick_ = (want[sk] > 0) & geo.first_of_tile[e]
        pieces = np.sort((sk * big + key)[pick_])
        n_k = np.bincount(sk[pick_], minlength=K)
        end = np.cumsum(n_k)
        thr = np.full(K, np.inf)
        thr[tails] = pieces[np.maximum(end - want, end - n_k)[tails]] % big
        main = (key < thr[sk]).astype(float)

    mid = None
    if geo.middle is not None:   # the dropped middle per [split, reducer]: units, block time, loads, finals, IB
        mu, mr, mo, mrem, mrr = (x[None, :] for x in geo.middle)
        ng, wd = valid.sum(1, keepdims=True), width.sum(1, keepdims=True)
        mid = np.stack([mu * ng, mu * (d_ns * valid).sum(1, keepdims=True) + mrem * ng * lk.put_issue_us,
                        mr * wd * eb * (L - 1) / (lk.nvlink_gbps * 1e3), mo * ng,
                        mo * (d_fin * valid).sum(1, keepdims=True), mrr * wd * eb / (lk.ib_gbps * 1e3)])
        at = np.flatnonzero(geo.early[e])                                 # the middle follows these slots
        mid_at = mid.reshape(6, -1)[:, seg[at]]

    def later(x, i):  # running sums of x, the dropped middle's row(s) i added after the early slots
        out = running(x)
        if mid is not None:
            out[..., at] += mid_at[i]
        return out

    h = (2 * L - 3) / (L - 1) if L > 2 else 1.0
    burst = ((h - 1) * (L - 1) * (nb * valid).sum(axis=1) / valid.sum(axis=1) / (lk.nvlink_gbps * 1e3))[:, None]
    span = (-(-(rows_c * tn) // C) * tu)[:, None]                                  # [split, 1]
    cb_s = cb[sk]
    us, ws, ls = later(v[1:4] * main if tails else v[1:4], slice(0, 3))
    t = v[0] + np.maximum(np.ceil(us / cb_s) * ws / np.maximum(us, 1), ls)
    ends = np.maximum(seg_max(t * main if tails else t), span)                     # [split, reducer]
    d_fin_max = d_fin.max(axis=1)[:, None]
    cbk = cb[:, None]
    if N > 1:
        fin_u, fin_t = seg_sum(v[4:6] * main if tails else v[4:6])
        if mid is not None:
            fin_u, fin_t = fin_u + mid[3], fin_t + mid[4]
        ends += np.ceil(fin_u / cbk) * fin_t / np.maximum(fin_u, 1)
        ib = v[6] * main if tails else v[6]  # my IB link carries my node partials of the other nodes' segments
        done = v[0] + v[2] / np.maximum(v[1], 1)       # the piece's node sum, then the puts from there on
        land = seg_max(np.where(ib > 0, done + later(ib, 5), 0.0))
        ends = np.maximum(ends, land + lk.ib_latency_us + d_fin_max)
    if tails:
        tb, tl = float(tail_blocks), 1.0 - main
        ut, wt, lt = seg_sum(v[1:4] * tl)
        ft, fw = seg_sum(v[4:6] * tl) if N > 1 else (np.zeros_like(ut), np.zeros_like(ut))
        e_tail = (lt.sum(axis=1, keepdims=True) - lt.min(axis=1, keepdims=True)) / max(L - 1, 1)
        ends = np.where((ends > span) & (ut.sum(axis=1, keepdims=True) > 0), ends + e_tail, ends)
        # the PEs with a tail start it at once: their loads queue on every peer's egress, the burst of all PEs at
        # once (`rs_comm_us`) when all have a tail, much less when few have (the cube of the share of the other
        # PEs: fitted to simulate_gemm_rs on the Llama-3-70B down projection, tests/test_plan_fast.py)
        busy = ((ut > 0).sum(axis=1, keepdims=True) - 1) / max(L - 1, 1)
        tail_end = span + np.maximum(np.maximum(np.ceil(ut / tb) * wt / np.maximum(ut, 1),
                                                lt + busy ** 3 * burst * np.minimum(ut, tb)),
                                     np.where(ut > 0, e_tail, 0.0))
        ends = np.maximum(ends, np.where(ut > 0, tail_end + np.ceil(ft / tb) * fw / np.maximum(ft, 1), 0.0))
        if N > 1:  # the tail's node partials of other nodes' segments go over IB before their final sums
            ib_t = seg_sum(v[6] * tl)
            land = tail_end + ib_t + lk.ib_latency_us + d_fin_max
            ends = np.maximum(ends, np.where(ib_t > 0, land, 0.0))
    return ends.max(axis=1)


def rs_comm_us(geo: RsGeometry, blocks: int, links: costs.Links) -> float:
    """`simulate._rs_comm_us` in closed form: the reduce-scatter alone (every partial in place, whole rows) on
    `blocks` blocks per PE, units at `_unit_us` each, the PE's NVLink ingress carrying (node_size - 1) loads of
    every unit with one burst of the queues of `simulate._Net.gather` (every PE starts at once), then for several
    nodes the puts of the node partials over IB and the final sums."""
    L, N, eb, lk = geo.node_size, geo.world // geo.node_size, geo.elem_bytes, links
    nb = geo.unit_rows * geo.n * eb
    d = float(_node_sum_us(nb, L, lk))
    units = np.bincount(geo.owner, weights=geo.units, minlength=L)
    rows = np.bincount(geo.owner, weights=geo.rows, minlength=L)
    link = rows * geo.n * eb * (L - 1) / (lk.nvlink_gbps * 1e3)
    h = (2 * L - 3) / (L - 1) if L > 2 else 1.0
    burst = (h - 1) * (L - 1) * nb / (lk.nvlink_gbps * 1e3) * np.minimum(units, blocks)
    remote_units = np.bincount(geo.owner, weights=geo.units * (1 - geo.own), minlength=L) if N > 1 else 0.0
    t = np.maximum(np.ceil(units / blocks) * d + np.ceil(remote_units / blocks) * lk.put_issue_us, link + burst)
    if N > 1:
        own_units = np.bincount(geo.owner, weights=geo.units * geo.own, minlength=L)
        ib = np.bincount(geo.owner, weights=geo.rows * (1 - geo.own), minlength=L) * geo.n * eb / (lk.ib_gbps * 1e3)
        t = np.maximum(t, ib + d + lk.ib_latency_us) + np.ceil(own_units / blocks) * float(_unit_us(nb, N, lk))
    return float(t.max())


@functools.lru_cache(maxsize=4096)
def rs_last_wave(tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int, group_tiles: int, clusters: int) -> int:
    """`search.rs_last_wave` from the last `clusters` work items alone: a piece is in the last wave when the item
    of its row with its group's last N-tile is."""
    rows = -(-tiles_m // cluster_m)
    items = rows * tiles_n
    s = max(1, min(swizzle, rows))
    g, idx = np.divmod(np.arange(max(0, items - clusters), items), s * tiles_n)
    nrows = np.minimum(s, rows - g * s)
    r, nt = g * s + idx % nrows, idx // nrows
    last = nt == np.minimum((nt // group_tiles + 1) * group_tiles, tiles_n) - 1
    return int(np.minimum(cluster_m, tiles_m - r * cluster_m)[last].sum())


REDUCED_WAVES = 4  # GEMM+RS estimates keep the tiles of the GEMM's last 4 waves (at least 32) and the first of each
#                    segment (`RsGeometry.reduced`)
EVAL_BATCH = 12     # GEMM+RS candidates estimated at once (the best bounds first: later ones may then be skipped)
EVAL_JOIN = 4       # ... and a remainder of up to 4 more goes with the batch instead of a round of its own
TAIL_KINDS = ("none", "last wave", "last wave and a cluster row")


def rs_tail(kind: int, tiles_m: int, tiles_n: int, cluster_m: int, swizzle: int, group_tiles: int,
            clusters: int) -> int:
    """The tail's pieces for a tail kind (`plan_gemm_rs`'s choices: none, the GEMM's last wave, or that and one
    cluster row more), at this M."""
    if kind == 0:
        return 0
    wave = rs_last_wave(tiles_m, tiles_n, cluster_m, swizzle, group_tiles, clusters)
    if kind == 1:
        return wave
    return min(wave + cluster_m * -(-tiles_n // group_tiles), tiles_m * -(-tiles_n // group_tiles))


@functools.lru_cache(maxsize=64)
def rs_geometry(world: int, node_size: int, m: int, n: int, elem_bytes: int, unit_rows: int, tile_m: int,
                tile_n: int) -> RsGeometry:
    """`RsGeometry.of`, once per call plan (the bucket's plan, its comm estimate and `rs_refine` share it); its
    arrays read-only, as they are shared."""
    geo = RsGeometry.of(world, node_size, m, n, elem_bytes, unit_rows, tile_m, tile_n)
    for f in dataclasses.fields(geo):
        if isinstance(getattr(geo, f.name), np.ndarray):
            getattr(geo, f.name).setflags(write=False)
    return geo


@functools.lru_cache(maxsize=64)
def _reduced_geometry(world: int, node_size: int, m: int, n: int, elem_bytes: int, unit_rows: int, tile_m: int,
                      tile_n: int, cluster_m: int, budget_sms: int) -> RsGeometry:
    geo = rs_geometry(world, node_size, m, n, elem_bytes, unit_rows, tile_m, tile_n)
    wave_tiles = -(-(budget_sms // cluster_m) // -(-n // tile_n)) * cluster_m
    return geo.reduced(-(-node_size // 16) * 16, -(-max(32, REDUCED_WAVES * wave_tiles) // 16) * 16)


def reduced_geometry(world: int, node_size: int, m: int, n: int, elem_bytes: int, unit_rows: int, gemm: costs.Gemm,
                     budget_sms: int) -> RsGeometry:
    """The geometry the estimates need: each reducer's first piece (in the order's first node_size tiles) and the
    tiles of the GEMM's last REDUCED_WAVES waves (at least 32) decide (`RsGeometry.reduced`; tests/test_plan_fast.py:
    the same estimates)."""
    return _reduced_geometry(world, node_size, m, n, elem_bytes, unit_rows, gemm.tile_m, gemm.tile_n,
                             gemm.cluster_m, budget_sms)


@dataclasses.dataclass(frozen=True)
class RsPlan:
    """`plan_gemm_rs`'s choice: the split, its prediction (and the decomposed path's), its tail kind (an index of
    TAIL_KINDS) and the (comm blocks, swizzle, width) of the best few splits, the chosen first."""

    split: search.Split
    predicted: S.Result
    tail_kind: int
    shortlist: tuple


SHORTLIST = 4  # GEMM+RS shapes a bucket keeps for `rs_refine` to choose among per M


def plan_gemm_rs(*, world: int, node_size: int, m: int, n: int, k: int, elem_bytes: int, gemm: costs.Gemm,
                 budget_sms: int, unit_rows: int, links: costs.Links = costs.Links(), comm_blocks: Optional[int] = None,
                 decomposed_comm_blocks: Optional[int] = None, group_tiles: Optional[int] = None,
                 swizzle: Optional[int] = None) -> RsPlan:
    """`search.plan_gemm_rs` from the closed-form model (`rs_estimates`), the same search: every (comm blocks,
    swizzle, width) without a tail, then tails for the three fastest and the fastest with whole rows; within 0.5%
    the simpler schedule. Candidates whose bound (search.plan_gemm_rs's) cannot win are skipped."""
    cm = gemm.cluster_m
    all_sms = budget_sms // cm * cm
    cands = search.split_candidates(("sm",), comm_blocks, budget_sms, cm, search.RS_COMM_BLOCKS)
    dec = decomposed_comm_blocks or max([c for _, c in cands] or [search.RS_COMM_BLOCKS[-1]])
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    comm = rs_comm_us(rs_geometry(world, node_size, m, n, elem_bytes, unit_rows, gemm.tile_m, gemm.tile_n), dec,
                      links)
    geo = reduced_geometry(world, node_size, m, n, elem_bytes, unit_rows, gemm, budget_sms)
    tail_blocks = min(all_sms, 64)
    g, lk = gemm.beside_comm(links), links.beside()
    # search.plan_gemm_rs's bound (its GEMM alone and, without a tail, the PE's node-sum bytes at the blocks'
    # rates): the same shapes reach the tail stage as there (a tighter bound would keep a shape that only wins
    # with a tail from ever getting one)
    seg_bytes = world // node_size * (m // world) * n * elem_bytes
    per_byte = max(1 / (lk.block_gbps * 1e3) if node_size > 1 else 0.0, (node_size + 1) / (lk.local_gbps * 1e3))
    bounds: dict = {}

    def sms(cb: int) -> int:
        return search.gemm_sms_for(budget_sms, cm, cb)

    def bound(c) -> float:
        if c not in bounds:
            cb, sw, gt, kind = c
            span = gemm_plain_us(tiles_m, tiles_n, cm, sms(cb), g.tile_us * costs.swizzle_cost(g, sw, tiles_m))
            bounds[c] = span if kind else max(span, seg_bytes * per_byte / cb)
        return bounds[c]

    est: dict = {}

    def evaluate(cs) -> None:
        """Estimate the candidates in `cs` whose bound beats the best so far (in rounds: best bounds first)."""
        todo = sorted(cs, key=bound)
        while todo:
            best = min(est.values()) if est else math.inf
            todo = [c for c in todo if bound(c) < best / 0.995]
            # (a round costs ~0.15 ms of numpy set-up however few candidates it holds: a short remainder joins)
            cut = len(todo) if len(todo) <= EVAL_BATCH + EVAL_JOIN else EVAL_BATCH
            batch, todo = todo[:cut], todo[cut:]
            if batch:
                splits = [RsSplit(sms(cb), cb, sw, gt, rs_tail(kind, tiles_m, tiles_n, cm, sw, gt, sms(cb) // cm))
                          for cb, sw, gt, kind in batch]
                est.update(zip(batch, rs_estimates(geo, g, splits, tail_blocks, lk).tolist()))

    shapes = [(cb, sw, gt, 0) for _, cb in cands
              for sw, gt in search.rs_shapes(tiles_m, tiles_n, cm, max(1, sms(cb) // cm), group_tiles, swizzle)]
    evaluate(shapes)
    # (shapes skipped above rank by their bound here: a tail may still make them win)
    ranked = sorted(shapes, key=lambda c: est.get(c, bound(c)))
    # (and, beyond search.plan_gemm_rs's three fastest and fastest with whole rows, the fastest of each comm
    # blocks count: the model's errors, a few percent, can reorder the no-tail splits that a tail then reorders)
    top = set(ranked[:3]) | set([c for c in ranked if c[1] == 1][:1]) | set({c[0]: c for c in ranked[::-1]}.values())
    evaluate([c[:3] + (kind,) for c in top for kind in (1, 2)])
    (cb, sw, gt, kind), fused = pick(sorted(est, key=lambda c: (c[1], c[0], c[3])), est.__getitem__)
    tail = rs_tail(kind, tiles_m, tiles_n, cm, sw, gt, sms(cb) // cm)
    gemm_f = gemm_plain_us(tiles_m, tiles_n, cm, sms(cb), gemm.tile_us * costs.swizzle_cost(gemm, sw, tiles_m))
    gemm_all = gemm_plain_us(tiles_m, tiles_n, cm, all_sms,
                             gemm.tile_us * costs.swizzle_cost(gemm, costs.PLAIN_SWIZZLE, tiles_m))
    r = S.Result("gemm_rs", fused, gemm_all + comm, comm, gemm_f, gemm_all, [fused], {"model": "fast"})
    # the shortlist: the choice, the runner-up shape of its comm blocks, and the best shape of each other comm
    # blocks count (the GEMM's wave quantization, which differs per count, moves with M inside a bucket)
    shapes_by_us = list(dict.fromkeys(c[:3] for c in sorted(est, key=est.__getitem__)))
    mine = [c for c in shapes_by_us if c[0] == cb and c != (cb, sw, gt)][:1]
    others = list({c[0]: c for c in reversed(shapes_by_us) if c[0] != cb}.values())
    others.sort(key=shapes_by_us.index)
    shortlist = tuple([(cb, sw, gt)] + mine + others)[:SHORTLIST]
    return RsPlan(search.Split("sm", cb, sms(cb), sw, tail, tail_blocks if tail else 0, gt), r, kind if tail else 0,
                  shortlist)


def rs_refine(*, world: int, node_size: int, m: int, n: int, elem_bytes: int, gemm: costs.Gemm, budget_sms: int,
              unit_rows: int, links: costs.Links, shortlist: Sequence[tuple]) -> tuple[search.Split, int]:
    """The split for this very M among a bucket's shortlisted (comm blocks, swizzle, width), each without a tail
    and with the last wave's (the first, the bucket's choice, with the longer tail too), in one `rs_estimates`
    batch: the GEMM's last wave, which decides the tail and the reduce units' shape, changes with M inside a
    bucket. Returns (split, tail kind)."""
    cm = gemm.cluster_m
    tiles_m, tiles_n = -(-m // gemm.tile_m), -(-n // gemm.tile_n)
    rows = -(-tiles_m // cm)
    tail_blocks = min(budget_sms // cm * cm, 64)
    cands = []
    for i, (cb, sw, gt) in enumerate(shortlist):
        sw = min(sw, 1 << (rows.bit_length() - 1))  # (a swizzle group never exceeds the M-tiles' cluster rows)
        for kind in ((0, 1, 2) if i == 0 else (0, 1)):  # (the longer tail: for the bucket's choice)
            c = (cb, sw, gt, kind)
            if c not in cands:
                cands.append(c)
    geo = reduced_geometry(world, node_size, m, n, elem_bytes, unit_rows, gemm, budget_sms)
    sms = {cb: search.gemm_sms_for(budget_sms, cm, cb) for cb, _, _ in shortlist}
    tails = {c: rs_tail(c[3], tiles_m, tiles_n, cm, c[1], c[2], sms[c[0]] // cm) for c in cands}
    us = rs_estimates(geo, gemm.beside_comm(links), [RsSplit(sms[c[0]], c[0], c[1], c[2], tails[c]) for c in cands],
                      tail_blocks, links.beside()).tolist()
    est = dict(zip(cands, us))
    (cb, sw, gt, kind), _ = pick(sorted(est, key=lambda c: (c[1], c[0], c[3])), est.__getitem__)
    tail = tails[(cb, sw, gt, kind)]
    return search.Split("sm", cb, sms[cb], sw, tail, tail_blocks if tail else 0, gt), kind if tail else 0
