// GEMM + ReduceScatter: persistent CUTLASS sm90 GEMMs writing the local partial D whose epilogue, after each tile's
// stores have landed, sets the tile's word of tile_ready to the epoch (system scope) for the reduce kernel. (The
// previous call's readers of D are done before the GEMM starts: every fused call begins with a barrier.)
//
// Kernels (one by-value parameter: the CUTLASS kernel's Params, filled by the host functions below):
//   fs_gemm_rs_{bf16,fp16}_{kn,nk}   D[M,N] = A[M,K] x B + bias[N]; B "kn" = [K,N] row-major, "nk" = [N,K] row-major
//   fs_gemm_rs_e4m3_nk            (the fp8 build, FS_GEMM_FP8=1, instead of the above) e4m3 A[M,K], B[N,K]:
//                                   bf16 D = scale_b[n] * (scale_a[m] * A x B) + bias[N], each scale a vector or one
//                                   float (scale_kind)
// Host library (FS_HOST_PASS): fs_gemm_rs_<dt>_<bl>_params / _params_size / _workspace_size, fs_gemm_last_error,
// fs_gemm_tile_m/n/k, fs_gemm_cluster_m/n, fs_gemm_pingpong, fs_gemm_fp8, fs_gemm_fp8_fast_accum, fs_abi_sizeof /
// fs_abi_offsetof.
#include "flux_shmem/gemm_ext.cuh"

#if FS_GEMM_FP8
// The fp8 build (flux_shmem/kernels/build.py, fp8=True): e4m3 A and B, bf16 D, fp32 scales.
namespace fs {
namespace gemm {
using RsE4m3Nk = GemmConfig<ScaledFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t>, true, Identity, RsEpilogue>;
using RsE4m3NkKernel = RsE4m3Nk::Kernel;
}  // namespace gemm
}  // namespace fs

FS_DEFINE_GEMM_KERNEL(fs_gemm_rs_e4m3_nk, fs::gemm::RsE4m3NkKernel)
#else
namespace fs {
namespace gemm {
using RsBf16Kn = GemmConfig<cutlass::bfloat16_t, false, Identity, RsEpilogue>;
using RsBf16Nk = GemmConfig<cutlass::bfloat16_t, true, Identity, RsEpilogue>;
using RsFp16Kn = GemmConfig<cutlass::half_t, false, Identity, RsEpilogue>;
using RsFp16Nk = GemmConfig<cutlass::half_t, true, Identity, RsEpilogue>;
using RsBf16KnKernel = RsBf16Kn::Kernel;
using RsBf16NkKernel = RsBf16Nk::Kernel;
using RsFp16KnKernel = RsFp16Kn::Kernel;
using RsFp16NkKernel = RsFp16Nk::Kernel;
}  // namespace gemm
}  // namespace fs

FS_DEFINE_GEMM_KERNEL(fs_gemm_rs_bf16_kn, fs::gemm::RsBf16KnKernel)
FS_DEFINE_GEMM_KERNEL(fs_gemm_rs_bf16_nk, fs::gemm::RsBf16NkKernel)
FS_DEFINE_GEMM_KERNEL(fs_gemm_rs_fp16_kn, fs::gemm::RsFp16KnKernel)
FS_DEFINE_GEMM_KERNEL(fs_gemm_rs_fp16_nk, fs::gemm::RsFp16NkKernel)
#endif  // FS_GEMM_FP8

#if defined(FS_HOST_PASS)
namespace fs {
namespace gemm {
namespace host {

// Checks `a` and fills the CUTLASS arguments; kOk or an error code with last_error set.
template <class Cfg>
int rs_args(const char* kname, const FsGemmRsArgs* a, typename Cfg::Kernel::Arguments& args) {
  if (a == nullptr) return fail(kErrArgs, std::string(kname) + ": null args");
  int rc = check_problem(kname, a->m, a->n, a->k, a->a, a->b, a->d, a->bias, a->sm_count,
                         a->swizzle, sizeof(typename Cfg::ElementA), sizeof(typename Cfg::ElementD));
  if (rc == kOk) rc = check_scales<Cfg>(kname, ScaleArgs{a->scale_a, a->scale_b, a->scale_kind});
  if (rc != kOk) return rc;
  if (a->tile_ready != nullptr && a->epoch == nullptr)
    return fail(kErrArgs, std::string(kname) + ": tile_ready needs epoch");
  fill_operands<Cfg>(args, a->m, a->n, a->k, a->a, a->b, a->d, a->bias, a->sm_count, a->device_id, a->m_tile_order,
                     a->swizzle, a->splits, a->tail_chunks, ScaleArgs{a->scale_a, a->scale_b, a->scale_kind});
  args.epilogue.tile_ready = a->tile_ready;
  args.epilogue.epoch = a->epoch;
  args.scheduler.ctx = to_ctx(a->ctx);
  return kOk;
}

template <class Cfg>
int rs_params(const char* kname, const FsGemmRsArgs* a, void* params_out, size_t params_cap, FsLaunch* launch) {
  typename Cfg::Kernel::Arguments args{};
  const int rc = rs_args<Cfg>(kname, a, args);
  if (rc != kOk) return rc;
  return finish_params<typename Cfg::Kernel>(kname, args, a->workspace, a->workspace_bytes, params_out, params_cap,
                                             launch);
}

template <class Cfg>
int64_t rs_workspace_size(const char* kname, const FsGemmRsArgs* a) {
  typename Cfg::Kernel::Arguments args{};
  return workspace_bytes<typename Cfg::Kernel>(kname, rs_args<Cfg>(kname, a, args), args);
}

}  // namespace host
}  // namespace gemm
}  // namespace fs

#define FS_RS_HOST(dt, bl, Cfg)                                                                              \
  extern "C" int fs_gemm_rs_##dt##_##bl##_params(const FsGemmRsArgs* a, void* params_out, size_t params_cap, \
                                                 FsLaunch* launch) {                                         \
    return fs::gemm::host::rs_params<Cfg>("fs_gemm_rs_" #dt "_" #bl, a, params_out, params_cap, launch);     \
  }                                                                                                          \
  extern "C" size_t fs_gemm_rs_##dt##_##bl##_params_size() { return sizeof(Cfg::Kernel::Params); }           \
  extern "C" int64_t fs_gemm_rs_##dt##_##bl##_workspace_size(const FsGemmRsArgs* a) {                        \
    return fs::gemm::host::rs_workspace_size<Cfg>("fs_gemm_rs_" #dt "_" #bl, a);                             \
  }

#if FS_GEMM_FP8
FS_RS_HOST(e4m3, nk, fs::gemm::RsE4m3Nk)
#else
FS_RS_HOST(bf16, kn, fs::gemm::RsBf16Kn)
FS_RS_HOST(bf16, nk, fs::gemm::RsBf16Nk)
FS_RS_HOST(fp16, kn, fs::gemm::RsFp16Kn)
FS_RS_HOST(fp16, nk, fs::gemm::RsFp16Nk)
#endif
#endif  // FS_HOST_PASS
