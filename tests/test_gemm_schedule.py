"""Work units of the persistent GEMM scheduler (csrc/include/flux_shmem/gemm_schedule.cuh), compiled with the host
C++ compiler and checked against a Python reference: every output tile computed exactly once (whole, or as K splits
that partition its K-tiles and sit next to each other in the unit order), whole waves before the split tail, the
swizzle's group order without padding tiles, dense reduction slots."""
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
  int cm, cn, group, splits, k_tiles; long long clusters;
  while (std::scanf("%d %d %d %d %d %lld", &cm, &cn, &group, &splits, &k_tiles, &clusters) == 6) {
    fs::UnitGrid g;
    g.clusters_m = cm; g.clusters_n = cn; g.group = group; g.splits = splits; g.k_tiles = k_tiles;
    g.dp_tiles = fs::dp_tiles_for(g, clusters);
    long long n = fs::unit_count(g);
    std::printf("%d %lld\n", g.dp_tiles, n);
    for (long long u = 0; u < n; ++u) {
      fs::Unit x = fs::unit_at(g, u);
      std::printf("%d %d %d %d %d %d %d\n", x.cm, x.cn, x.split, x.splits, x.k_start, x.k_count, x.slot);
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
        stdin = "".join(" ".join(str(v) for v in c) + "\n" for c in cases)
        lines = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split("\n")
        pos, out = 0, []
        for _ in cases:
            dp, n = (int(v) for v in lines[pos].split())
            pos += 1
            units = [tuple(int(v) for v in lines[pos + i].split()) for i in range(n)]
            pos += n
            out.append((dp, units))
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


def check_case(case, dp, units):
    cm, cn, group, splits, k_tiles, clusters = case
    tiles = cm * cn
    want_dp = tiles if splits == 1 else tiles // clusters * clusters
    assert dp == want_dp, case
    raster = reference_raster(cm, cn, group)
    assert len(units) == dp + (tiles - dp) * splits, case
    # whole tiles first, in raster order
    for u in range(dp):
        assert units[u] == (*raster[u], 0, 1, 0, k_tiles, -1), (case, u)
    # then each tail tile as `splits` consecutive units partitioning [0, k_tiles), slots 0, 1, 2, ...
    for j, t in enumerate(range(dp, tiles)):
        chunk = units[dp + j * splits: dp + (j + 1) * splits]
        assert all((u[0], u[1]) == raster[t] for u in chunk), (case, t)
        assert [u[2] for u in chunk] == list(range(splits)) and all(u[3] == splits for u in chunk), (case, t)
        assert all(u[5] >= 1 for u in chunk), (case, t)  # splits <= k_tiles: no empty split
        assert chunk[0][4] == 0 and chunk[-1][4] + chunk[-1][5] == k_tiles, (case, t)
        assert all(a[4] + a[5] == b[4] for a, b in zip(chunk, chunk[1:])), (case, t)
        assert all(u[6] == (j if splits > 1 else -1) for u in chunk), (case, t)
    assert sorted(set((u[0], u[1]) for u in units)) == sorted(raster)


def test_units_cover_every_tile_once(enumerate_units):
    rng = random.Random(11)
    cases = [(32, 5, 8, 2, 128, 66), (32, 14, 8, 1, 128, 66), (4, 5, 4, 3, 128, 66), (1, 1, 1, 1, 1, 66),
             (7, 3, 8, 4, 9, 5), (64, 28, 8, 1, 16, 62), (5, 5, 2, 16, 16, 3), (3, 1, 8, 2, 2, 66)]
    for _ in range(300):
        cm, cn = rng.randint(1, 40), rng.randint(1, 30)
        k_tiles = rng.randint(1, 200)
        cases.append((cm, cn, rng.randint(1, min(cm, 8)), rng.randint(1, min(16, k_tiles)), k_tiles,
                      rng.randint(1, 140)))
    for case, (dp, units) in zip(cases, enumerate_units(cases)):
        check_case(case, dp, units)


def test_no_padding_tiles(enumerate_units):
    """14 N-tiles at swizzle 8 stay 14 (CUTLASS's scheduler would run 16): units = tiles exactly."""
    (dp, units), = enumerate_units([(32, 14, 8, 1, 128, 66)])
    assert len(units) == 32 * 14 and max(u[1] for u in units) == 13


def test_split_tail_fills_the_last_wave(enumerate_units):
    """8192x1280x8192 with 128x256 tiles in 2x1 clusters on 132 SMs: 160 cluster tiles on 66 clusters, 2 whole
    waves (132) and 28 tiles split 2-way: 56 units in the last wave."""
    (dp, units), = enumerate_units([(32, 5, 8, 2, 128, 66)])
    assert dp == 132 and len(units) - dp == 56


@pytest.mark.parametrize("tiles_m,tiles_n,swizzle,sms", [(64, 14, 1, 124), (64, 14, 8, 132), (7, 5, 4, 132),
                                                          (33, 3, 2, 16), (64, 32, 8, 128)])
def test_simulator_walks_the_kernels_units(enumerate_units, tiles_m, tiles_n, swizzle, sms):
    """flux_shmem/ops/simulate.py gemm_work is the scheduler's unit order (no split): cluster c takes units c,
    c + C, ... and unit u is cluster tile unit_at(u)."""
    from flux_shmem.ops.simulate import gemm_work
    rows = -(-tiles_m // 2)
    work = gemm_work(tiles_m, tiles_n, 2, swizzle, sms)
    clusters = len(work)
    _, units = enumerate_units([(rows, tiles_n, max(1, min(swizzle, rows)), 1, 1, clusters)])[0]
    expect = [[] for _ in range(clusters)]
    for u, (cm, cn, *_rest) in enumerate(units):
        expect[u % clusters].append((cm, cn))
    assert work == expect
