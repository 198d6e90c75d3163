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

#if FS_GEMM_FP8
// The fp8 build (flux_shmem/kernels/build.py, fp8=True): e4m3 A and B, bf16 D, fp32 scales.
namespace fs {
namespace gemm {
using AgE4m3Nk = GemmConfig<ScaledFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t>, true, AgMainloop, Identity>;
using AgE4m3NkKernel = AgE4m3Nk::Kernel;
}  // namespace gemm
}  // namespace fs

FS_DEFINE_GEMM_KERNEL(fs_ag_gemm_e4m3_nk, fs::gemm::AgE4m3NkKernel)
#else
namespace fs {
namespace gemm {
using AgBf16Kn = GemmConfig<cutlass::bfloat16_t, false, AgMainloop, Identity>;
using AgBf16Nk = GemmConfig<cutlass::bfloat16_t, true, AgMainloop, Identity>;
using AgFp16Kn = GemmConfig<cutlass::half_t, false, AgMainloop, Identity>;
using AgFp16Nk = GemmConfig<cutlass::half_t, true, AgMainloop, Identity>;
using AgBf16KnKernel = AgBf16Kn::Kernel;
using AgBf16NkKernel = AgBf16Nk::Kernel;
using AgFp16KnKernel = AgFp16Kn::Kernel;
using AgFp16NkKernel = AgFp16Nk::Kernel;
}  // namespace gemm
}  // namespace fs

FS_DEFINE_GEMM_KERNEL(fs_ag_gemm_bf16_kn, fs::gemm::AgBf16KnKernel)
FS_DEFINE_GEMM_KERNEL(fs_ag_gemm_bf16_nk, fs::gemm::AgBf16NkKernel)
FS_DEFINE_GEMM_KERNEL(fs_ag_gemm_fp16_kn, fs::gemm::AgFp16KnKernel)
FS_DEFINE_GEMM_KERNEL(fs_ag_gemm_fp16_nk, fs::gemm::AgFp16NkKernel)
#endif  // FS_GEMM_FP8

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

#if FS_GEMM_FP8
FS_AG_HOST(e4m3, nk, fs::gemm::AgE4m3Nk)
#else
FS_AG_HOST(bf16, kn, fs::gemm::AgBf16Kn)
FS_AG_HOST(bf16, nk, fs::gemm::AgBf16Nk)
FS_AG_HOST(fp16, kn, fs::gemm::AgFp16Kn)
FS_AG_HOST(fp16, nk, fs::gemm::AgFp16Nk)
#endif
#endif  // FS_HOST_PASS
