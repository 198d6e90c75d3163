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

// One kernel per entry of the build's type list (gemm_config.cuh FS_GEMM_BUILD_TYPES): fs::gemm::Rs_<dt>_<bl> is
// its configuration, fs_gemm_rs_<dt>_<bl> its entry.
#define FS_RS_KERNEL(dt, bl, Element, nk)                                                                             \
  namespace fs {                                                                                                      \
  namespace gemm {                                                                                                    \
  using Rs_##dt##_##bl = GemmConfig<Element, nk, Identity, RsEpilogue>;                                               \
  using Rs_##dt##_##bl##_kernel = Rs_##dt##_##bl::Kernel;                                                             \
  }                                                                                                                   \
  }                                                                                                                   \
  FS_DEFINE_GEMM_KERNEL(fs_gemm_rs_##dt##_##bl, fs::gemm::Rs_##dt##_##bl##_kernel)
FS_GEMM_BUILD_TYPES(FS_RS_KERNEL)

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

#define FS_RS_HOST_OF(dt, bl, Element, nk) FS_RS_HOST(dt, bl, fs::gemm::Rs_##dt##_##bl)
FS_GEMM_BUILD_TYPES(FS_RS_HOST_OF)
#endif  // FS_HOST_PASS
