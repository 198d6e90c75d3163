// Work units of one persistent GEMM launch: pure index arithmetic used by the tile scheduler (gemm_ext.cuh) and
// tested on the CPU (tests/test_gemm_schedule.py compiles this header with g++).
//
// Output tiles are grouped into clusters (cluster_m x cluster_n CTA tiles, the tile counts padded to whole
// clusters); a unit is one cluster tile over all of K or over one K split. Cluster tiles follow CUTLASS's AlongN
// raster with swizzle `group`: `group` consecutive clusters along M walk across every N cluster together (M fastest
// within the group), group after group; the last group takes the clusters left over and may be narrower. (CUTLASS's
// own scheduler rounds both the M and the N cluster counts up to a multiple of the swizzle and computes the padding
// tiles in full: 14 N-tiles at swizzle 8 ran 16, 1.14x the work.)
//
// Split-K of the tail: with P persistent clusters, the first dp_tiles = floor(T / P) * P cluster tiles of the raster
// (whole waves) run unsplit, one unit each; each remaining tile (the last, partial wave) runs as `splits`
// consecutive units over consecutive K ranges, so that its units run in the same wave and each split-K reduction
// waits only on peers that are running. With T < P every tile is split; with splits = 1 nothing is.
// Persistent cluster c processes units c, c + P, c + 2P, ...
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define FS_GS_HD __host__ __device__ __forceinline__
#else
#define FS_GS_HD inline
#endif

namespace fs {

struct UnitGrid {
  int32_t clusters_m = 1;  // cluster tiles along M (ceil(tiles_m / cluster_m))
  int32_t clusters_n = 1;  // cluster tiles along N
  int32_t group = 1;       // swizzle: clusters along M per group, 1 <= group <= clusters_m
  int32_t splits = 1;      // K splits of each tile after the first dp_tiles, 1 <= splits <= k_tiles
  int32_t k_tiles = 1;     // K-tiles of one output tile
  int32_t dp_tiles = 0;    // cluster tiles (a prefix of the raster) computed whole
};

struct Unit {
  int32_t cm;       // cluster index along M
  int32_t cn;       // cluster index along N
  int32_t split;    // 0 .. splits-1
  int32_t splits;   // 1 for a whole tile
  int32_t k_start;  // first K-tile of this unit
  int32_t k_count;  // K-tiles of this unit (>= 1 when splits <= k_tiles)
  int32_t slot;     // index of the tile among the split ones (its reduction workspace slot), -1 when whole
};

FS_GS_HD int64_t cluster_tiles(const UnitGrid& g) { return static_cast<int64_t>(g.clusters_m) * g.clusters_n; }

// First tile of the tail: whole waves of `clusters` persistent clusters run unsplit (all tiles when splits == 1).
FS_GS_HD int32_t dp_tiles_for(const UnitGrid& g, int64_t clusters) {
  const int64_t t = cluster_tiles(g);
  if (g.splits <= 1 || clusters <= 0) return static_cast<int32_t>(t);
  return static_cast<int32_t>(t / clusters * clusters);
}

FS_GS_HD int64_t unit_count(const UnitGrid& g) {
  return g.dp_tiles + (cluster_tiles(g) - g.dp_tiles) * g.splits;
}

// Cluster tile t (raster order) -> its cluster coordinates.
FS_GS_HD void cluster_of(const UnitGrid& g, int64_t t, int32_t* cm, int32_t* cn) {
  const int64_t span = static_cast<int64_t>(g.group) * g.clusters_n;  // cluster tiles of one full group
  const int32_t full_groups = g.clusters_m / g.group;
  int64_t grp = t / span;
  int32_t width = g.group;
  int64_t rem = t - grp * span;
  if (grp >= full_groups) {  // the narrower last group
    grp = full_groups;
    width = g.clusters_m - full_groups * g.group;
    rem = t - static_cast<int64_t>(full_groups) * span;
  }
  *cm = static_cast<int32_t>(grp * g.group + rem % width);
  *cn = static_cast<int32_t>(rem / width);
}

// Unit u, 0 <= u < unit_count(g).
FS_GS_HD Unit unit_at(const UnitGrid& g, int64_t u) {
  Unit r;
  int64_t t;
  if (u < g.dp_tiles) {
    t = u;
    r.split = 0;
    r.splits = 1;
    r.k_start = 0;
    r.k_count = g.k_tiles;
    r.slot = -1;
  } else {
    const int64_t v = u - g.dp_tiles;
    const int64_t s = v / g.splits;
    t = g.dp_tiles + s;
    r.split = static_cast<int32_t>(v - s * g.splits);
    r.splits = g.splits;
    r.k_start = static_cast<int32_t>(static_cast<int64_t>(r.split) * g.k_tiles / g.splits);
    r.k_count = static_cast<int32_t>(static_cast<int64_t>(r.split + 1) * g.k_tiles / g.splits) - r.k_start;
    r.slot = g.splits > 1 ? static_cast<int32_t>(s) : -1;
  }
  cluster_of(g, t, &r.cm, &r.cn);
  return r;
}

}  // namespace fs
