"""Work units of the persistent GEMM scheduler (csrc/include/flux_shmem/gemm_schedule.cuh), compiled with the host
C++ compiler and checked against a Python reference: every output tile computed exactly once (whole, or as pieces
that partition its K-tiles), whole waves before the stream-K tail, the tail's K-tiles shared evenly by the clusters,
the swizzle's group order without padding tiles, one reduction slot per split tile, and the split-K reduction
protocol (pieces in reduction order) run to completion by an event simulation without waits across clusters'
later work; with aligned ranges (chunks q), every range starting at one of a tile's q chunk boundaries."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_MAIN = r"""
#include <cstdio>
#include "flux_shmem/gemm_schedule.cuh"
int main() {
  int cm, cn, group, splits, k_tiles, chunks; long long clusters;
  while (std::scanf("%d %d %d %d %d %lld %d", &cm, &cn, &group, &splits, &k_tiles, &clusters, &chunks) == 7) {
    fs::UnitGrid g;
    g.clusters_m = cm; g.clusters_n = cn; g.group = group; g.splits = splits; g.k_tiles = k_tiles;
    g.chunks = chunks;
    fs::plan_tail(&g, clusters);
    long long n = fs::unit_count(g);
    std::printf("%d %d %d %lld\n", g.dp_tiles, g.tail_units, g.stride, n);
    for (long long u = 0; u < n; ++u) {
      fs::Unit x = fs::unit_at(g, u);
      std::printf("%d %d %d %d %d %d %d %d\n", x.cm, x.cn, x.split, x.splits, x.k_start, x.k_count, x.slot,
                  int(x.valid));
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def enumerate_units(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++)")
    tmp = tmp_path_factory.mktemp("sched")
    src, exe = tmp / "units.cpp", tmp / "units"
    src.write_text(_MAIN)
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'include'}", str(src), "-o", str(exe)],
                   check=True)

    def run(cases):
        """cases: (clusters_m, clusters_n, group, splits, k_tiles, clusters[, chunks])."""
        stdin = "".join(" ".join(str(v) for v in (tuple(c) + (0,))[:7]) + "\n" for c in cases)
        lines = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split("\n")
        pos, out = 0, []
        for _ in cases:
            dp, tail_units, stride, n = (int(v) for v in lines[pos].split())
            pos += 1
            units = [tuple(int(v) for v in lines[pos + i].split()) for i in range(n)]
            pos += n
            out.append(((dp, tail_units, stride), units))
        return out
    return run


def reference_raster(cm: int, cn: int, group: int) -> list[tuple[int, int]]:
    """Cluster tiles in scheduling order: groups of `group` M clusters (the last one narrower) walk all N."""
    order = []
    for g0 in range(0, cm, group):
        width = min(group, cm - g0)
        for n in range(cn):
            for i in range(width):
                order.append((g0 + i, n))
    return order


def reference_plan(case):
    """(dp_tiles, tail_units, stride): the chooser's model of the plan (config.tail_plan), so the kernel is checked
    against what the model ranks, and the launch's clusters (the stride) as the header's comment defines them."""
    from flux_shmem.kernels.config import tail_plan
    cm, cn, _group, splits, k_tiles, clusters, chunks = (tuple(case) + (0,))[:7]
    tiles = cm * cn
    dp, u = tail_plan(tiles, clusters, splits, k_tiles, chunks)
    if u == 0:
        return dp, 0, max(1, min(tiles, clusters))
    return dp, u, clusters if dp > 0 else u


def cluster_items(plan, units):
    """Per cluster, its units in the order it runs them (c, c + stride, ...) up to its first invalid one."""
    dp, _u, stride = plan
    out = []
    for c in range(stride):
        items = []
        for i in range(c, len(units), stride):
            if not units[i][7]:
                assert all(not units[j][7] for j in range(i, len(units), stride)), "valid unit after an invalid one"
                break
            items.append((i,) + units[i][:7])
        out.append(items)
    return out


def simulate_protocol(items_by_cluster, step=lambda it: it[6]):
    """Run every cluster's items in order, each taking `step(item)` time after it may start; a piece of reduction
    order r > 0 starts its reduction only when the tile's lock has reached r (the r pieces before it arrived); a
    piece that is not its tile's last counts itself on the lock when done. Returns each cluster's finish time;
    raises on a deadlock."""
    import heapq
    lock, arrived_at = {}, {}
    pos = [0] * len(items_by_cluster)
    clock = [0.0] * len(items_by_cluster)
    done = [None] * len(items_by_cluster)
    waiting = {}
    events = [(0.0, c) for c in range(len(items_by_cluster))]
    heapq.heapify(events)
    while events:
        t, c = heapq.heappop(events)
        while pos[c] < len(items_by_cluster[c]):
            _, cm, cn, split, splits, k_start, k_count, slot = items_by_cluster[c][pos[c]]
            tile = (cm, cn)
            ready = t + step(items_by_cluster[c][pos[c]])
            if split > 0:
                have = lock.get(tile, 0)
                if have < split:
                    waiting.setdefault(tile, []).append(c)
                    clock[c] = ready
                    break
                ready = max(ready, arrived_at[(tile, split - 1)])
            if splits > 1 and split < splits - 1:
                lock[tile] = lock.get(tile, 0) + 1
                arrived_at[(tile, split)] = ready
                for w in waiting.pop(tile, []):
                    heapq.heappush(events, (max(clock[w], ready) - step(items_by_cluster[w][pos[w]]), w))
            t = ready
            pos[c] += 1
        else:
            done[c] = t
    stuck = [c for c, d in enumerate(done) if d is None]
    if stuck:
        raise AssertionError(f"deadlock: clusters {stuck[:8]} wait for their tiles' earlier pieces")
    return done


def check_case(case, plan, units):
    from flux_shmem.kernels.config import tail_chunks, tail_ranges
    cm, cn, group, splits, k_tiles, clusters, chunks = (tuple(case) + (0,))[:7]
    tiles = cm * cn
    assert plan == reference_plan(case), case
    dp, u, stride = plan
    raster = reference_raster(cm, cn, group)
    for i in range(dp):  # whole tiles first, in raster order, wave after wave
        assert units[i] == (*raster[i], 0, 1, 0, k_tiles, -1, 1), (case, i)
    assert all(x[7] == 0 or i < dp for i, x in enumerate(units)) or u > 0, case
    items = cluster_items(plan, units)
    assert all(not items[c][len([x for x in items[c] if x[0] < dp]):] for c in range(u, stride)), \
        (case, "a cluster beyond the tail's ranges got tail work")
    pieces = {}
    for c, its in enumerate(items):
        tail = [x for x in its if x[0] >= dp]
        for x in tail:
            pieces.setdefault((x[1], x[2]), []).append((c,) + x)
        if u and c < u:
            work = sum(x[6] for x in tail)  # the range's K-tiles: its chunks [c n / U, (c+1) n / U)
            first, end = tail_ranges(tiles - dp, u, k_tiles, chunks)[c]
            assert work == end - first >= 1, (case, c)
            q = tail_chunks(k_tiles, chunks)  # it starts on a chunk boundary of its first tile
            assert first % k_tiles in {i * k_tiles // q for i in range(q)}, (case, c)
            if tail:
                assert tail[0][5] == first % k_tiles and (tail[0][1], tail[0][2]) == raster[dp + first // k_tiles]
    assert sorted(pieces) == sorted(raster[dp:]), case  # every tail tile, once
    slots = []
    for tile, ps in pieces.items():
        n = len(ps)
        ps.sort(key=lambda p: p[6])  # by k_start
        assert ps[0][6] == 0 and ps[-1][6] + ps[-1][7] == k_tiles, (case, tile)
        assert all(a[6] + a[7] == b[6] for a, b in zip(ps, ps[1:])), (case, tile)
        assert all(p[7] >= 1 and p[5] == n for p in ps), (case, tile)
        assert [p[4] for p in ps] == list(range(n - 1, -1, -1)), (case, tile)  # K-tile 0's piece reduces last
        assert [p[0] for p in ps] == list(range(ps[0][0], ps[0][0] + n)), (case, tile)  # consecutive ranges
        assert all(p[8] == (ps[0][0] if n > 1 else -1) for p in ps), (case, tile)  # slot: the last piece's range
        if n > 1:
            slots.append(ps[0][8])
    assert len(set(slots)) == len(slots) and all(0 <= s < max(u, 1) for s in slots), case
    # The reduction protocol completes, and (reductions free) as fast as the longest cluster: no serial chain.
    finish = simulate_protocol(items)
    assert max(finish) == max(sum(x[6] for x in its) for its in items), case


def _random_cases(seed, n):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        cm, cn = rng.randint(1, 40), rng.randint(1, 30)
        k_tiles = rng.randint(1, 200)
        chunks = rng.choice([0, 0, 1, 2, 3, 4, 6, 8, k_tiles, k_tiles + 5])
        cases.append((cm, cn, rng.randint(1, min(cm, 8)), rng.randint(1, min(16, k_tiles)), k_tiles,
                      rng.randint(1, 140), chunks))
    return cases


def test_units_cover_every_tile_once(enumerate_units):
    cases = [(32, 5, 8, 2, 128, 66), (32, 14, 8, 1, 128, 66), (4, 5, 4, 3, 128, 66), (1, 1, 1, 1, 1, 66),
             (7, 3, 8, 4, 9, 5), (64, 28, 8, 1, 16, 62), (5, 5, 2, 16, 16, 3), (3, 1, 8, 2, 2, 66),
             (4, 6, 4, 3, 64, 66), (4, 6, 4, 16, 1, 66), (2, 1, 1, 16, 3, 66), (33, 2, 8, 2, 1, 66)]
    cases += _random_cases(11, 400)
    for case, (plan, units) in zip(cases, enumerate_units(cases)):
        check_case(case, plan, units)


def test_no_padding_tiles(enumerate_units):
    """14 N-tiles at swizzle 8 stay 14 (CUTLASS's scheduler would run 16): units = tiles exactly."""
    (_plan, units), = enumerate_units([(32, 14, 8, 1, 128, 66)])
    assert len(units) == 32 * 14 and max(u[1] for u in units) == 13


def test_stream_k_tail_fills_the_last_waves(enumerate_units):
    """8192x1280x8192 with 128x256 tiles in 2x1 clusters on 132 SMs: 160 cluster tiles on 66 clusters. With a split,
    one whole wave (66 tiles) runs whole and the other 94 tiles' 94 x 128 K-tiles are shared by the 66 clusters:
    182 or 183 K-tiles each (the 2.42 waves of work, against 3 whole waves)."""
    ((dp, u, stride), units), = enumerate_units([(32, 5, 8, 2, 128, 66)])
    assert (dp, u, stride) == (66, 66, 66)
    items = cluster_items((dp, u, stride), units)
    assert {sum(x[6] for x in its if x[0] >= dp) for its in items} == {182, 183}


def test_stream_k_below_one_wave(enumerate_units):
    """1024x768x4096 with 128x128 tiles in 2x1 clusters: 24 cluster tiles of 64 K-tiles. split=2 gives 48 ranges
    (the old equal split in two), split=3 all 66 clusters with 23 or 24 K-tiles each, a tile in at most 4 pieces."""
    (p2, u2), (p3, u3) = enumerate_units([(4, 6, 1, 2, 64, 66), (4, 6, 1, 3, 64, 66)])
    assert p2 == (0, 48, 48) and p3 == (0, 66, 66)
    halves = [x for x in u2 if x[7]]
    assert len(halves) == 48 and {x[5] for x in halves} == {32} and {x[3] for x in halves} == {2}
    work = [sum(x[6] for x in its) for its in cluster_items(p3, u3)]
    assert set(work) == {23, 24} and max(x[3] for x in u3 if x[7]) <= 4


@pytest.mark.parametrize("tiles_m,tiles_n,swizzle,sms", [(64, 14, 1, 124), (64, 14, 8, 132), (7, 5, 4, 132),
                                                          (33, 3, 2, 16), (64, 32, 8, 128)])
def test_simulator_walks_the_kernels_units(enumerate_units, tiles_m, tiles_n, swizzle, sms):
    """flux_shmem/ops/simulate.py gemm_work is the scheduler's unit order (no split): cluster c takes units c,
    c + C, ... and unit u is cluster tile unit_at(u)."""
    from flux_shmem.plan.simulate import gemm_work
    rows = -(-tiles_m // 2)
    work = gemm_work(tiles_m, tiles_n, 2, swizzle, sms)
    clusters = len(work)
    _, units = enumerate_units([(rows, tiles_n, max(1, min(swizzle, rows)), 1, 1, clusters)])[0]
    expect = [[] for _ in range(clusters)]
    for u, (cm, cn, *_rest) in enumerate(units):
        expect[u % clusters].append((cm, cn))
    assert work == expect


def test_aligned_tail_walks_k_at_few_offsets(enumerate_units):
    """4096x1280x8192 with 128x256 tiles in 2x1 clusters on 132 SMs: 80 cluster tiles of 128 K-tiles, all stream-K on
    66 clusters. Unaligned ranges start at 33 K offsets (their clusters share no K-slab); with chunks=4 at the 4
    quarter boundaries only, the longest range 160 K-tiles (5 quarters) where unaligned ranges are 155-156."""
    (p0, u0), (p4, u4) = enumerate_units([(16, 5, 1, 2, 128, 66, 0), (16, 5, 1, 2, 128, 66, 4)])
    assert p0 == p4 == (0, 66, 66)
    starts0 = {its[0][5] for its in cluster_items(p0, u0)}
    starts4 = {its[0][5] for its in cluster_items(p4, u4)}
    assert len(starts0) >= 30 and starts4 == {0, 32, 64, 96}
    work0 = {sum(x[6] for x in its) for its in cluster_items(p0, u0)}
    work4 = {sum(x[6] for x in its) for its in cluster_items(p4, u4)}
    assert work0 == {155, 156} and work4 == {128, 160}
    assert max(x[3] for x in u4 if x[7]) <= 4  # a tile in at most 4 pieces (one per quarter)


def test_chunks_beyond_k_tiles_mean_unaligned(enumerate_units):
    """chunks = 0, = k_tiles and > k_tiles plan the same units (the kernel clamps as fs::tail_chunks does)."""
    out = enumerate_units([(32, 5, 8, 2, 128, 66, 0), (32, 5, 8, 2, 128, 66, 128), (32, 5, 8, 2, 128, 66, 999)])
    assert out[0] == out[1] == out[2]
