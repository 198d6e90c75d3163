/* C ABI of the CUTLASS GEMM families (ag_gemm, gemm_rs): argument structs read by the host libraries'
 * `fs_<family>_<dt>_<bl>_params` functions and the launch geometry they return.
 *
 * Plain C, fixed-width types, explicit padding: mirrored field by field with ctypes in
 * flux_shmem/kernels/gemm.py; tests/test_gemm_build.py compares every size and offset with
 * fs_abi_sizeof() / fs_abi_offsetof() exported by the host libraries, so the mirrors cannot drift.
 */
#ifndef FLUX_SHMEM_GEMM_ABI_H
#define FLUX_SHMEM_GEMM_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FsAgGemmArgs / FsGemmRsArgs scale_kind bits: which fp8 scale is a vector (the other is one float). */
#define FS_SCALE_ROWWISE_A 1   /* scale_a is float[M]: one per row of A (of D) */
#define FS_SCALE_ROWWISE_B 2   /* scale_b is float[N]: one per row of the [N, K] B (per column of D) */

/* C twin of fs::Ctx (signal.cuh): same fields, same layout (static_asserts in gemm_ext.cuh). */
typedef struct FsCtx {
  void* err;              /* fs::ErrorSlot* (device memory: claim word + pointer to the pinned ErrorRecord), or NULL */
  uint64_t timeout_ns;    /* bound of every signal wait */
  int32_t my_pe;
  int32_t n_pes;
  int32_t trap_on_timeout;
  int32_t pad_;
} FsCtx;

/* Launch geometry of one GEMM: block is always (384, 1, 1), grid.x is a multiple of cluster.x. */
typedef struct FsLaunch {
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t cluster[3];
  uint32_t smem_bytes;    /* dynamic shared memory */
} FsLaunch;

/* AllGather + GEMM: D[M,N] = A[M,K] (the gather buffer) x B + bias[N]. */
typedef struct FsAgGemmArgs {
  int64_t m, n, k;
  const void* a;                 /* [M, K] row-major */
  const void* b;                 /* "kn": [K, N] row-major; "nk": [N, K] row-major */
  void* d;                       /* [M, N] row-major */
  const void* bias;              /* [N] or NULL */
  int32_t sm_count;              /* persistent CTAs (> 0) */
  int32_t device_id;
  const uint64_t* chunk_flags;   /* [shards * chunks_per_shard], ready when >= *epoch */
  const uint64_t* epoch;         /* device word: the value every chunk flag must reach */
  int32_t rows_per_shard;        /* Ms */
  int32_t chunk_rows;
  int32_t chunks_per_shard;      /* must equal ceil(Ms / chunk_rows) when wait != 0 */
  int32_t wait;                  /* 0: plain GEMM (no flag reads) */
  const int32_t* m_tile_order;   /* [tiles_m] permutation of M-tiles, or NULL (identity) */
  int32_t swizzle;               /* 1, 2, 4 or 8 (0 = 1): CTAs walk groups of swizzle * cluster_m M-tiles */
  int32_t pad_;
  FsCtx ctx;
  /* added for split-K (issue 11); new fields go at the end */
  int32_t splits;                /* 0 or 1: whole tiles; S > 1: the last two waves as stream-K, about S pieces per
                                    tile at most (gemm_schedule.cuh); needs the workspace */
  int32_t tail_chunks;           /* 0: the stream-K tail's ranges start at any K-tile; q > 0: only where one of q
                                    equal K chunks of a tile starts, so its clusters walk K at q offsets, sharing
                                    A and B in L2 (issue 24; was padding, 0, before) */
  void* workspace;               /* zeroed once when allocated (the kernel resets its locks), or NULL */
  uint64_t workspace_bytes;      /* size of workspace (fs_<family>_<dt>_<bl>_workspace_size) */
  /* added for fp8 (issue 26): the e4m3 kernels' fp32 scales, D = scale_b * (scale_a * A x B) + bias; both NULL in
     the 16-bit kernels */
  const void* scale_a;           /* float[M] with FS_SCALE_ROWWISE_A in scale_kind, else one float (device memory) */
  const void* scale_b;           /* float[N] with FS_SCALE_ROWWISE_B in scale_kind, else one float (device memory) */
  int32_t scale_kind;            /* FS_SCALE_ROWWISE_A | FS_SCALE_ROWWISE_B, or 0: both per-tensor */
  int32_t pad2_;
} FsAgGemmArgs;

/* GEMM + ReduceScatter: D[M,N] (local partial) = A[M,K] x B + bias[N]; marks each finished tile in tile_ready. */
typedef struct FsGemmRsArgs {
  int64_t m, n, k;
  const void* a;
  const void* b;
  void* d;
  const void* bias;              /* [N] or NULL */
  int32_t sm_count;
  int32_t device_id;
  uint64_t* tile_ready;          /* [tiles_m * tiles_n] words: tile (m, n)'s = *epoch once D holds it; or NULL (plain
                                    GEMM) */
  const uint64_t* epoch;
  const int32_t* m_tile_order;   /* [tiles_m] permutation of M-tiles, or NULL (identity) */
  int32_t swizzle;               /* as in FsAgGemmArgs */
  int32_t pad_;
  FsCtx ctx;
  int32_t splits;                /* as in FsAgGemmArgs */
  int32_t tail_chunks;           /* as in FsAgGemmArgs */
  void* workspace;
  uint64_t workspace_bytes;
  const void* scale_a;           /* as in FsAgGemmArgs */
  const void* scale_b;
  int32_t scale_kind;
  int32_t pad2_;
} FsGemmRsArgs;

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* FLUX_SHMEM_GEMM_ABI_H */
