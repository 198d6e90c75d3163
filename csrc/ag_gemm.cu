// AllGather + GEMM: persistent CUTLASS sm90 GEMMs whose TMA producer waits, per tile, for the all-gather chunks
// holding the tile's rows (flags raised by the separate NVSHMEM comm kernel), visiting M-tiles in a given order.
//
// Kernels (one by-value parameter: the CUTLASS kernel's Params, filled by the host functions below):
//   fs_ag_gemm_{bf16,fp16}_{kn,nk}   D[M,N] = A[M,K] x B + bias[N]; B "kn" = [K,N] row-major, "nk" = [N,K] row-major
//   fs_ag_gemm_e4m3_nk            (the fp8 build, FS_GEMM_FP8=1, instead of the above) e4m3 A[M,K], B[N,K]:
//                                   bf16 D = scale_b[n] * (scale_a[m] * A x B) + bias[N], each scale a vector or one
//                                   float (scale_kind)
// Host library (FS_HOST_PASS): fs_ag_gemm_<dt>_<bl>_params / _params_size / _workspace_size, fs_gemm_last_error,
// fs_gemm_tile_m/n/k, fs_gemm_cluster_m/n, fs_gemm_pingpong, fs_gemm_fp8, fs_gemm_fp8_fast_accum, fs_abi_sizeof /
// fs_abi_offsetof.
#include "flux_shmem/gemm_ext.cuh"

// One kernel per entry of the build's type list (gemm_config.cuh FS_GEMM_BUILD_TYPES): fs::gemm::Ag_<dt>_<bl> is
// its configuration, fs_ag_gemm_<dt>_<bl> its entry.
#define FS_AG_KERNEL(dt, bl, Element, nk)                                                                             \
  namespace fs {                                                                                                      \
  namespace gemm {                                                                                                    \
  using Ag_##dt##_##bl = GemmConfig<Element, nk, AgMainloop, Identity>;                                               \
  using Ag_##dt##_##bl##_kernel = Ag_##dt##_##bl::Kernel;                                                             \
  }                                                                                                                   \
  }                                                                                                                   \
  FS_DEFINE_GEMM_KERNEL(fs_ag_gemm_##dt##_##bl, fs::gemm::Ag_##dt##_##bl##_kernel)
FS_GEMM_BUILD_TYPES(FS_AG_KERNEL)

#if defined(FS_HOST_PASS)
namespace fs {
namespace gemm {
namespace host {

// Checks `a` and fills the CUTLASS arguments; kOk or an error code with last_error set.
template <class Cfg>
int ag_args(const char* kname, const FsAgGemmArgs* a, typename Cfg::Kernel::Arguments& args) {
  if (a == nullptr) return fail(kErrArgs, std::string(kname) + ": null args");
  int rc = check_problem(kname, a->m, a->n, a->k, a->a, a->b, a->d, a->bias, a->sm_count,
                         a->swizzle, sizeof(typename Cfg::ElementA), sizeof(typename Cfg::ElementD));
  if (rc == kOk) rc = check_scales<Cfg>(kname, ScaleArgs{a->scale_a, a->scale_b, a->scale_kind});
  if (rc != kOk) return rc;
  if (a->wait) {
    char buf[512];
    if (a->chunk_flags == nullptr || a->epoch == nullptr) {
      return fail(kErrArgs, std::string(kname) + ": wait=1 needs chunk_flags and epoch");
    }
    if (a->rows_per_shard <= 0 || a->chunk_rows <= 0 ||
        a->chunks_per_shard != fs::ceil_div_int(a->rows_per_shard, a->chunk_rows)) {
      std::snprintf(buf, sizeof buf,
                    "%s: inconsistent chunking: rows_per_shard=%d chunk_rows=%d chunks_per_shard=%d (must be "
                    "ceil(rows_per_shard / chunk_rows))",
                    kname, a->rows_per_shard, a->chunk_rows, a->chunks_per_shard);
      return fail(kErrArgs, buf);
    }
  }
  fill_operands<Cfg>(args, a->m, a->n, a->k, a->a, a->b, a->d, a->bias, a->sm_count, a->device_id, a->m_tile_order,
                     a->swizzle, a->splits, a->tail_chunks, ScaleArgs{a->scale_a, a->scale_b, a->scale_kind});
  args.mainloop.chunk_flags = a->chunk_flags;
  args.mainloop.epoch = a->epoch;
  args.mainloop.rows_per_shard = a->rows_per_shard;
  args.mainloop.chunk_rows = a->chunk_rows;
  args.mainloop.chunks_per_shard = a->chunks_per_shard;
  args.mainloop.wait = a->wait ? 1 : 0;
  args.mainloop.ctx = to_ctx(a->ctx);
  args.scheduler.ctx = to_ctx(a->ctx);
  return kOk;
}

template <class Cfg>
int ag_params(const char* kname, const FsAgGemmArgs* a, void* params_out, size_t params_cap, FsLaunch* launch) {
  typename Cfg::Kernel::Arguments args{};
  const int rc = ag_args<Cfg>(kname, a, args);
  if (rc != kOk) return rc;
  return finish_params<typename Cfg::Kernel>(kname, args, a->workspace, a->workspace_bytes, params_out, params_cap,
                                             launch);
}

template <class Cfg>
int64_t ag_workspace_size(const char* kname, const FsAgGemmArgs* a) {
  typename Cfg::Kernel::Arguments args{};
  return workspace_bytes<typename Cfg::Kernel>(kname, ag_args<Cfg>(kname, a, args), args);
}

}  // namespace host
}  // namespace gemm
}  // namespace fs

#define FS_AG_HOST(dt, bl, Cfg)                                                                              \
  extern "C" int fs_ag_gemm_##dt##_##bl##_params(const FsAgGemmArgs* a, void* params_out, size_t params_cap, \
                                                 FsLaunch* launch) {                                         \
    return fs::gemm::host::ag_params<Cfg>("fs_ag_gemm_" #dt "_" #bl, a, params_out, params_cap, launch);     \
  }                                                                                                          \
  extern "C" size_t fs_ag_gemm_##dt##_##bl##_params_size() { return sizeof(Cfg::Kernel::Params); }           \
  extern "C" int64_t fs_ag_gemm_##dt##_##bl##_workspace_size(const FsAgGemmArgs* a) {                        \
    return fs::gemm::host::ag_workspace_size<Cfg>("fs_ag_gemm_" #dt "_" #bl, a);                             \
  }

#define FS_AG_HOST_OF(dt, bl, Element, nk) FS_AG_HOST(dt, bl, fs::gemm::Ag_##dt##_##bl)
FS_GEMM_BUILD_TYPES(FS_AG_HOST_OF)
#endif  // FS_HOST_PASS
