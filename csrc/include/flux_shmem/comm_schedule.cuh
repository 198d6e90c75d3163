// Which piece of communication each unit of work is, for the all-gather and reduce-scatter engines.
// Pure index arithmetic, __host__ __device__ so the CPU tests compile and check it (tests/test_schedules.py).
//
// PEs are grouped in "nodes" of L consecutive PEs that reach each other by load/store (NVLink). Between nodes only
// NVSHMEM puts work. The engines are two-level: across nodes each PE talks only to the PE with its own local index;
// inside a node data moves by direct stores. L = 1 makes every peer "remote" (the forced put path).
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

// ---------------------------------------------------------------------------------------------------------------
// All-gather. Shard s (of PE s) is split into `chunks` chunks; unit kinds in the order every PE processes them:
//   kLocal:   copy my shard's chunk into my own slot of the gather buffer (the GEMM's local tiles need nothing else)
//   kPut:     put my chunk to the PE with my local index on another node (IB in flight while NVLink works)
//   kDirect:  store my chunk into a local peer's gather buffer
//   kForward: a chunk that arrived from another node, stored on to a local peer
// Chunk-major inside each phase so every destination receives chunk 0 first.
enum AgKind : int { kLocal = 0, kPut = 1, kDirect = 2, kForward = 3 };

struct AgUnit {
  int kind, src, dest, chunk;
};

FS_HD int ag_num_units(const Topo& t, int chunks) { return chunks * t.world; }

FS_HD AgUnit ag_unit(const Topo& t, int chunks, int u) {
  const int L = t.node_size, Nn = t.nodes(), n = t.node(), l = t.local();
  if (u < chunks) return {kLocal, t.me, t.me, u};
  u -= chunks;
  if (u < (Nn - 1) * chunks) {
    const int c = u / (Nn - 1), j = 1 + u % (Nn - 1);
    return {kPut, t.me, t.pe((n + j) % Nn, l), c};
  }
  u -= (Nn - 1) * chunks;
  if (u < (L - 1) * chunks) {
    const int c = u / (L - 1), i = 1 + u % (L - 1);
    return {kDirect, t.me, t.pe(n, (l + i) % L), c};
  }
  u -= (L - 1) * chunks;
  const int per_node = (L - 1) * chunks;  // forwards of one remote node's shard
  const int j = 1 + u / per_node;
  u %= per_node;
  const int c = u / (L - 1), i = 1 + u % (L - 1);
  return {kForward, t.pe((n + j) % Nn, l), t.pe(n, (l + i) % L), c};
}

// Byte range of chunk c of a shard of shard_bytes split in chunks of chunk_bytes.
FS_HD uint64_t chunk_begin(uint64_t chunk_bytes, int c) { return chunk_bytes * uint64_t(c); }
FS_HD uint64_t chunk_size(uint64_t shard_bytes, uint64_t chunk_bytes, int c) {
  const uint64_t b = chunk_bytes * uint64_t(c);
  return b >= shard_bytes ? 0 : (shard_bytes - b < chunk_bytes ? shard_bytes - b : chunk_bytes);
}

// ---------------------------------------------------------------------------------------------------------------
// Reduce-scatter. PE s owns rows [s*Ms, (s+1)*Ms) of the [M, N] sum. Rows are cut at multiples of unit_rows (which
// divides the GEMM tile height, so a unit never spans two M-tiles) and at segment boundaries.
//   Phase A, for each segment s with my local index, other nodes' segments first and my own node's last:
//     sum the unit's rows over the PEs of my node (direct loads); with one node that is the final result, else the
//     node partial goes to PE s (put-with-signal) or, for my own segment, into my own receive slot.
//   Phase B (more than one node): for my segment, sum the node partials in node order (deterministic), add bias.
FS_HD int rs_units_in_segment(int64_t Ms, int unit_rows, int s) {
  const int64_t lo = int64_t(s) * Ms, hi = lo + Ms;
  return int((hi + unit_rows - 1) / unit_rows - lo / unit_rows);
}
FS_HD int rs_max_units_per_segment(int64_t Ms, int unit_rows) { return int(Ms / unit_rows) + 2; }

// Global rows [lo, hi) of unit u of segment s.
FS_HD void rs_unit_rows(int64_t Ms, int unit_rows, int s, int u, int64_t* lo, int64_t* hi) {
  const int64_t seg_lo = int64_t(s) * Ms, seg_hi = seg_lo + Ms;
  const int64_t a = (seg_lo / unit_rows + u) * unit_rows, b = a + unit_rows;
  *lo = a > seg_lo ? a : seg_lo;
  *hi = b < seg_hi ? b : seg_hi;
}

struct RsUnit {
  int phase;  // 0: A (node-level sum), 1: B (final sum over nodes)
  int seg;    // segment (= owning PE)
  int u;      // unit index inside the segment
};

FS_HD int rs_num_units(const Topo& t, int64_t Ms, int unit_rows) {
  int total = 0;
  for (int j = 1; j <= t.nodes(); ++j) total += rs_units_in_segment(Ms, unit_rows, t.pe((t.node() + j) % t.nodes(), t.local()));
  if (t.nodes() > 1) total += rs_units_in_segment(Ms, unit_rows, t.me);
  return total;
}

FS_HD RsUnit rs_unit(const Topo& t, int64_t Ms, int unit_rows, int idx) {
  for (int j = 1; j <= t.nodes(); ++j) {
    const int s = t.pe((t.node() + j) % t.nodes(), t.local());
    const int k = rs_units_in_segment(Ms, unit_rows, s);
    if (idx < k) return {0, s, idx};
    idx -= k;
  }
  return {1, t.me, idx};
}

}  // namespace fs
