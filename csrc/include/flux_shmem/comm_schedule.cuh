// Index arithmetic the communication engines share. The schedules themselves (who sends what, in which order)
// are plans made in Python (flux_shmem/ops/_schedule.py) and read as tables; this header only maps plan items to
// bytes and rows. __host__ __device__ so the CPU tests compile and check it against the Python twins.
//
// PEs are grouped in "nodes" of L consecutive PEs that reach each other by load/store (NVLink). Between nodes only
// NVSHMEM puts work. L = 1 makes every peer "remote" (the forced put path).
#pragma once
#include <cstdint>

#ifndef FS_HD
#if defined(__CUDACC__)
#define FS_HD __host__ __device__ __forceinline__
#else
#define FS_HD inline
#endif
#endif

namespace fs {

struct Topo {
  int me, world, node_size;  // node_size = L; world % L == 0
  FS_HD int nodes() const { return world / node_size; }
  FS_HD int node() const { return me / node_size; }
  FS_HD int local() const { return me % node_size; }
  FS_HD int pe(int node, int local) const { return node * node_size + local; }
};

// Byte range of chunk c of a shard of shard_bytes split in chunks of chunk_bytes.
FS_HD uint64_t chunk_begin(uint64_t chunk_bytes, int c) { return chunk_bytes * uint64_t(c); }
FS_HD uint64_t chunk_size(uint64_t shard_bytes, uint64_t chunk_bytes, int c) {
  const uint64_t b = chunk_bytes * uint64_t(c);
  return b >= shard_bytes ? 0 : (shard_bytes - b < chunk_bytes ? shard_bytes - b : chunk_bytes);
}

// Reduce-scatter: PE s owns rows [s*Ms, (s+1)*Ms) of the [M, N] sum. Global rows [lo, hi) of row unit r of
// segment s: segments are cut at multiples of unit_rows (which divides the GEMM tile height, so a unit never spans
// two M-tiles) and at segment boundaries (_schedule.py rs_unit_rows).
FS_HD void rs_unit_rows(int64_t Ms, int unit_rows, int s, int r, int64_t* lo, int64_t* hi) {
  const int64_t seg_lo = int64_t(s) * Ms, seg_hi = seg_lo + Ms;
  const int64_t a = (seg_lo / unit_rows + r) * unit_rows, b = a + unit_rows;
  *lo = a > seg_lo ? a : seg_lo;
  *hi = b < seg_hi ? b : seg_hi;
}

// Unit u of segment s (_schedule.py RsUnits): row unit u / groups, columns [c0, c1) of column group u % groups
// (group_tiles N-tiles of tile_n columns, the last narrower). A node partial travels packed: rows x (c1 - c0)
// elements at `slot` inside the segment's [Ms, N] block of the stage / receive buffers (each row unit's block holds
// its groups one after another).
struct RsRect {
  int64_t lo, hi, c0, c1, slot;
};

FS_HD RsRect rs_unit(int64_t Ms, int unit_rows, int64_t n, int tile_n, int group_tiles, int s, int u) {
  const int tiles_n = int((n + tile_n - 1) / tile_n);
  const int groups = (tiles_n + group_tiles - 1) / group_tiles;
  RsRect r;
  rs_unit_rows(Ms, unit_rows, s, u / groups, &r.lo, &r.hi);
  r.c0 = int64_t(u % groups) * group_tiles * tile_n;
  const int64_t c1 = r.c0 + int64_t(group_tiles) * tile_n;
  r.c1 = c1 < n ? c1 : n;
  r.slot = (r.lo - int64_t(s) * Ms) * n + (r.hi - r.lo) * r.c0;
  return r;
}

}  // namespace fs
