// Pure index arithmetic shared by the GEMM kernels, the host parameter code and the CPU unit tests.
//
// No CUDA or CUTLASS include: this header compiles with a plain C++ compiler (g++ -x c++) as well as with nvcc.
//
// All-gather layout: the gathered A has M rows made of consecutive shards of `rows_per_shard` (Ms) rows; shard s is
// split into `chunks_per_shard` chunks of `chunk_rows` rows (the last one ragged):
//   chunk (s, c) covers rows [s*Ms + c*chunk_rows, s*Ms + min((c+1)*chunk_rows, Ms)),
//   its flag is chunk_flags[s * chunks_per_shard + c].
// A GEMM tile of `tile_m` rows starting at row t*tile_m needs every chunk overlapping its rows below M.
#pragma once

#if defined(__CUDACC__)
#define FS_TS_HD __host__ __device__ __forceinline__
#else
#define FS_TS_HD inline
#endif

namespace fs {

// The chunks overlapping one tile's rows, as the first and last (shard, chunk) pair in row order.
// Every (s, c) between them in row order overlaps the tile: for s in [s0, s1], c runs from (s == s0 ? c0 : 0)
// to (s == s1 ? c1 : chunks_per_shard - 1). `empty` when the tile has no row below M (nothing to wait for).
struct ChunkSpan {
  int s0, c0, s1, c1;
  int empty;
};

FS_TS_HD int ceil_div_int(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

// Rows [row_begin, row_end) (clipped to M by the caller) -> overlapping chunk span.
FS_TS_HD ChunkSpan chunk_span_for_rows(long long row_begin, long long row_end, int rows_per_shard, int chunk_rows) {
  ChunkSpan r{0, 0, -1, -1, 1};
  if (row_end <= row_begin || rows_per_shard <= 0 || chunk_rows <= 0) return r;
  const long long first = row_begin, last = row_end - 1;
  r.s0 = static_cast<int>(first / rows_per_shard);
  r.c0 = static_cast<int>((first - static_cast<long long>(r.s0) * rows_per_shard) / chunk_rows);
  r.s1 = static_cast<int>(last / rows_per_shard);
  r.c1 = static_cast<int>((last - static_cast<long long>(r.s1) * rows_per_shard) / chunk_rows);
  r.empty = 0;
  return r;
}

// The chunk span of M-tile `m_tile` (tile_m rows per tile) of a GEMM with M rows.
FS_TS_HD ChunkSpan chunk_span_for_tile(int m_tile, int tile_m, long long M, int rows_per_shard, int chunk_rows) {
  long long begin = static_cast<long long>(m_tile) * tile_m;
  long long end = begin + tile_m;
  if (end > M) end = M;
  return chunk_span_for_rows(begin, end, rows_per_shard, chunk_rows);
}

// Number of (shard, chunk) pairs in a span (chunks_per_shard = chunks of one shard).
FS_TS_HD int chunk_span_count(const ChunkSpan& sp, int chunks_per_shard) {
  if (sp.empty) return 0;
  return (sp.s1 - sp.s0) * chunks_per_shard + sp.c1 - sp.c0 + 1;
}

// Flat flag index of the i-th pair of the span (0 <= i < chunk_span_count): s * chunks_per_shard + c.
// Pairs are consecutive flat indices because chunks are numbered in row order.
FS_TS_HD int chunk_span_flag(const ChunkSpan& sp, int chunks_per_shard, int i) {
  return sp.s0 * chunks_per_shard + sp.c0 + i;
}

// Tiles along one dimension.
FS_TS_HD int tiles_along(long long extent, int tile) { return extent <= 0 ? 0 : ceil_div_int(extent, tile); }

}  // namespace fs

#undef FS_TS_HD
