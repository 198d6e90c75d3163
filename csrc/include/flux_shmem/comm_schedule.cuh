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

// Reduce-scatter: PE s owns rows [s*Ms, (s+1)*Ms) of the [M, N] sum. Global rows [lo, hi) of unit u of segment s:
// segments are cut at multiples of unit_rows (which divides the GEMM tile height, so a unit never spans two
// M-tiles) and at segment boundaries (_schedule.py rs_unit_rows).
FS_HD void rs_unit_rows(int64_t Ms, int unit_rows, int s, int u, int64_t* lo, int64_t* hi) {
  const int64_t seg_lo = int64_t(s) * Ms, seg_hi = seg_lo + Ms;
  const int64_t a = (seg_lo / unit_rows + u) * unit_rows, b = a + unit_rows;
  *lo = a > seg_lo ? a : seg_lo;
  *hi = b < seg_hi ? b : seg_hi;
}

}  // namespace fs
