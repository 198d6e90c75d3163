// Work units of one persistent GEMM launch: pure index arithmetic used by the tile scheduler (gemm_scheduler.cuh) and
// tested on the CPU (tests/test_gemm_schedule.py compiles this header with g++).
//
// Output tiles are grouped into clusters (cluster_m x cluster_n CTA tiles, the tile counts padded to whole
// clusters); a unit is one cluster tile over all of K or over one K split. Cluster tiles follow CUTLASS's AlongN
// raster with swizzle `group`: `group` consecutive clusters along M walk across every N cluster together (M fastest
// within the group), group after group; the last group takes the clusters left over and may be narrower. (CUTLASS's
// own scheduler rounds both the M and the N cluster counts up to a multiple of the swizzle and computes the padding
// tiles in full: 14 N-tiles at swizzle 8 ran 16, 1.14x the work.)
//
// The tail (stream-K): with P persistent clusters, T cluster tiles and splits S > 1, the first dp_tiles tiles of the
// raster run whole, one unit each, in whole waves: all waves but the last whole one (dp_tiles = (floor(T/P) - 1) * P,
// 0 with fewer than two waves). The remaining tail tiles (the last partial wave and the whole wave before it, or all
// tiles with fewer than one wave) are one stream of tail_tiles x k_tiles K-tiles, cut evenly into
// U = min(P, tail_tiles * S, tail_tiles * k_tiles) ranges, one per cluster: cluster c computes K-tiles
// [floor(c W / U), floor((c+1) W / U)) of the stream, W = tail_tiles * k_tiles, as one unit per tile its range
// touches (its "items", in stream order). A tile touched by several ranges is a split tile: its pieces add up
// in a workspace slot in reduction order, the piece with the highest K first and the piece with K-tile 0 last
// (that one runs the epilogue). Why that order: the pieces of a tile after the one with K-tile 0 lie in later
// ranges that start inside the tile, so they are those clusters' first items; every wait is then for first items
// of later clusters, never for a cluster's later work: no chain across tiles, no deadlock when all clusters are
// resident (the launch checks occupancy). With T % P == 0 nothing is split. When U divides into tail_tiles evenly, every
// tail tile runs as U / tail_tiles equal splits (the old split-K of the tail). Cluster c processes units c, c + C,
// c + 2C, ... with C = stride: P with whole tiles before the tail, else U (the grid has exactly C clusters).
//
// Aligned ranges (chunks q, 1 <= q <= k_tiles; 0 means k_tiles): ranges then start only where one of q equal chunks
// of a tile starts (chunk i of a tile begins at K-tile floor(i k_tiles / q)): the stream is tail_tiles x q chunks,
// U = min(P, tail_tiles * S, tail_tiles * q) and cluster c takes chunks [floor(c n / U), floor((c+1) n / U)),
// n = tail_tiles * q. Why: clusters start the tail together and walk K at one rate, so with q chunks their K
// offsets take only q values, and the clusters at one offset read the same K-slabs of A and B, which L2 then
// shares, as it does for a wave of whole tiles. Unaligned ranges (q = k_tiles: the even K-tile split above) start
// at as many offsets as clusters, and the tail's operands cross DRAM about once per tile (RESULTS.md, 2026-12-06:
// stream-K at 0.84 of cuBLAS where whole tiles ran 0.97). The price is balance: ranges differ by up to a chunk.
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
  int32_t splits = 1;      // S: at most S ranges per tail tile on average (1: no tail, every tile whole)
  int32_t k_tiles = 1;     // K-tiles of one output tile
  int32_t chunks = 0;      // q: the tail's ranges start at chunk boundaries of a tile (0 or > k_tiles: k_tiles)
  int32_t dp_tiles = 0;    // cluster tiles (a prefix of the raster) computed whole
  int32_t tail_units = 0;  // U: ranges the tail is cut into (0: no tail)
  int32_t stride = 1;      // C: persistent clusters of the launch
};

struct Unit {
  int32_t cm;       // cluster index along M
  int32_t cn;       // cluster index along N
  int32_t split;    // reduction order of this piece among its tile's pieces, 0 .. splits-1 (0: whole tile)
  int32_t splits;   // pieces of this tile (1 for a whole tile)
  int32_t k_start;  // first K-tile of this unit
  int32_t k_count;  // K-tiles of this unit (>= 1)
  int32_t slot;     // reduction workspace slot of a split tile (the index of its last piece's range), else -1
  bool valid;       // false past a cluster's last item
};

FS_GS_HD int64_t cluster_tiles(const UnitGrid& g) { return static_cast<int64_t>(g.clusters_m) * g.clusters_n; }

// The chunks of a tile that range boundaries may fall on (1 .. k_tiles).
FS_GS_HD int64_t tail_chunks(const UnitGrid& g) {
  return (g.chunks <= 0 || g.chunks > g.k_tiles) ? g.k_tiles : g.chunks;
}

// dp_tiles, tail_units and stride of g (its other fields set) on `clusters` persistent clusters.
FS_GS_HD void plan_tail(UnitGrid* g, int64_t clusters) {
  const int64_t t = cluster_tiles(*g);
  if (clusters < 1) clusters = 1;
  g->tail_units = 0;
  if (g->splits <= 1 || t % clusters == 0) {  // whole tiles, whole waves
    g->dp_tiles = static_cast<int32_t>(t);
    g->stride = static_cast<int32_t>(t < clusters ? (t < 1 ? 1 : t) : clusters);
    return;
  }
  const int64_t waves = t / clusters;
  g->dp_tiles = static_cast<int32_t>(waves >= 1 ? (waves - 1) * clusters : 0);
  const int64_t tail = t - g->dp_tiles;
  int64_t u = clusters;
  if (tail * g->splits < u) u = tail * g->splits;
  if (tail * tail_chunks(*g) < u) u = tail * tail_chunks(*g);
  g->tail_units = static_cast<int32_t>(u);
  g->stride = static_cast<int32_t>(g->dp_tiles > 0 ? clusters : u);
}

// Work units to walk: the whole tiles, then per cluster as many items as the longest range can touch (units past a
// cluster's last item are invalid; a cluster stops at its first invalid unit).
FS_GS_HD int64_t unit_count(const UnitGrid& g) {
  if (g.tail_units <= 0) return g.dp_tiles;
  const int64_t q = tail_chunks(g), n = (cluster_tiles(g) - g.dp_tiles) * q;
  const int64_t longest = (n + g.tail_units - 1) / g.tail_units * ((g.k_tiles + q - 1) / q);  // K-tiles, at most
  const int64_t items = (longest + g.k_tiles - 2) / g.k_tiles + 1;  // a range of L K-tiles touches <= this many tiles
  return g.dp_tiles + items * g.stride;
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

// The tail's stream in chunks (q per tile, chunk i of a tile starting at its K-tile floor(i kt / q)): range c
// starts at chunk floor(c n / U); the stream K-tile where chunk j starts; the chunk holding stream K-tile x; the
// range holding chunk j.
FS_GS_HD int64_t range_start(int64_t c, int64_t n, int64_t u) { return c * n / u; }
FS_GS_HD int64_t chunk_start(int64_t j, int64_t q, int64_t kt) { return j / q * kt + j % q * kt / q; }
FS_GS_HD int64_t chunk_of(int64_t x, int64_t q, int64_t kt) { return x / kt * q + ((x % kt + 1) * q - 1) / kt; }
FS_GS_HD int64_t range_of(int64_t j, int64_t n, int64_t u) { return ((j + 1) * u - 1) / n; }

// Unit id, 0 <= id < unit_count(g).
FS_GS_HD Unit unit_at(const UnitGrid& g, int64_t id) {
  Unit r;
  r.valid = true;
  int64_t t;
  if (id < g.dp_tiles) {
    t = id;
    r.split = 0;
    r.splits = 1;
    r.k_start = 0;
    r.k_count = g.k_tiles;
    r.slot = -1;
  } else {
    const Unit none{0, 0, 0, 1, 0, 0, -1, false};
    const int64_t v = id - g.dp_tiles, item = v / g.stride, c = v - item * g.stride;
    const int64_t u = g.tail_units, kt = g.k_tiles, q = tail_chunks(g), n = (cluster_tiles(g) - g.dp_tiles) * q;
    if (u <= 0 || c >= u) return none;  // no tail, or a cluster beyond its ranges
    const int64_t a = chunk_start(range_start(c, n, u), q, kt), b = chunk_start(range_start(c + 1, n, u), q, kt);
    const int64_t tile = a / kt + item, ts = tile * kt;  // the tail tile of this item and its first stream K-tile
    if (ts >= b) return none;  // past the range's last item
    const int64_t lo = range_of(chunk_of(ts, q, kt), n, u), hi = range_of(chunk_of(ts + kt - 1, q, kt), n, u);
    const int64_t k0 = a > ts ? a : ts, k1 = b < ts + kt ? b : ts + kt;
    t = g.dp_tiles + tile;
    r.split = static_cast<int32_t>(hi - c);
    r.splits = static_cast<int32_t>(hi - lo + 1);
    r.k_start = static_cast<int32_t>(k0 - ts);
    r.k_count = static_cast<int32_t>(k1 - k0);
    r.slot = r.splits > 1 ? static_cast<int32_t>(lo) : -1;
  }
  cluster_of(g, t, &r.cm, &r.cn);
  return r;
}

}  // namespace fs
