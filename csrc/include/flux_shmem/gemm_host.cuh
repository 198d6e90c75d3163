// Host side (FS_HOST_PASS): the helpers of the families' extern "C" functions, the TMA-descriptor driver shim and
// the ABI introspection.
// Part of gemm_ext.cuh (include that, not this file): it relies on what gemm_ext.cuh includes first.
#pragma once

// ------------------------------------------------------------------------------------------------------------------
// Host side (FS_HOST_PASS): shared helpers of the families' extern "C" functions
// ------------------------------------------------------------------------------------------------------------------
#if defined(FS_HOST_PASS)
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace fs {
namespace gemm {
namespace host {

inline std::string& last_error() {
  static thread_local std::string msg;
  return msg;
}

inline int fail(int code, const std::string& msg) {
  last_error() = msg;
  return code;
}

// Result of the last cuTensorMapEncodeTiled made through the shim (CUTLASS only prints and asserts on failure).
inline CUresult& tma_encode_status() {
  static thread_local CUresult status = CUDA_SUCCESS;
  return status;
}

using EncodeTiledFn = CUresult(CUDAAPI*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                         const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                         CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                         CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled from libcuda.so.1 (loaded once), or null where there is no driver.
inline EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    return lib == nullptr ? nullptr : reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
  }();
  return fn;
}

// Error codes of the _params functions.
enum : int {
  kOk = 0,
  kErrArgs = 1,         // null/invalid argument or shape
  kErrAlign = 2,        // pointer or leading dimension not 16-byte aligned
  kErrCapacity = 3,     // params_cap too small
  kErrCannotImplement = 4,
  kErrWorkspace = 5,    // split-K without a (large enough, aligned) workspace
  kErrTma = 6,          // cuTensorMapEncodeTiled failed (no driver, bad address, ...)
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline fs::Ctx to_ctx(const FsCtx& c) {
  fs::Ctx ctx;
  std::memcpy(&ctx, &c, sizeof(ctx));
  return ctx;
}

// Common checks of the problem; returns kOk or a code with last_error set. elem_bytes: of A and B; d_elem_bytes:
// of D and bias (0: the same).
inline int check_problem(const char* kname, int64_t m, int64_t n, int64_t k, const void* a, const void* b,
                         const void* d, const void* bias, int32_t sm_count, int32_t swizzle, size_t elem_bytes,
                         size_t d_elem_bytes = 0) {
  char buf[512];
  if (swizzle != 0 && swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8) {
    std::snprintf(buf, sizeof buf, "%s: swizzle must be 1, 2, 4 or 8 (0 means 1), got %d", kname, swizzle);
    return fail(kErrArgs, buf);
  }
  if (m <= 0 || n <= 0 || k <= 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    std::snprintf(buf, sizeof buf, "%s: bad problem size m=%lld n=%lld k=%lld (each must be in [1, 2^31))", kname,
                  (long long)m, (long long)n, (long long)k);
    return fail(kErrArgs, buf);
  }
  if (a == nullptr || b == nullptr || d == nullptr) {
    std::snprintf(buf, sizeof buf, "%s: null operand pointer (a=%p b=%p d=%p)", kname, a, b, d);
    return fail(kErrArgs, buf);
  }
  if (sm_count <= 0) {
    std::snprintf(buf, sizeof buf, "%s: sm_count must be > 0 (got %d): pass the device's multiprocessor count",
                  kname, sm_count);
    return fail(kErrArgs, buf);
  }
  if (!aligned16(a) || !aligned16(b) || !aligned16(d) || (bias != nullptr && !aligned16(bias))) {
    std::snprintf(buf, sizeof buf, "%s: operands must be 16-byte aligned (a=%p b=%p d=%p bias=%p)", kname, a, b, d,
                  bias);
    return fail(kErrAlign, buf);
  }
  const int64_t align_elems = 16 / static_cast<int64_t>(elem_bytes);
  const int64_t align_n = d_elem_bytes == 0 ? align_elems : 16 / static_cast<int64_t>(d_elem_bytes);
  if (align_n == align_elems && (n % align_elems != 0 || k % align_elems != 0)) {
    std::snprintf(buf, sizeof buf,
                  "%s: n=%lld and k=%lld must be multiples of %lld (16-byte rows for TMA)", kname, (long long)n,
                  (long long)k, (long long)align_elems);
    return fail(kErrAlign, buf);
  }
  if (k % align_elems != 0 || n % align_n != 0) {  // fp8 ("nk" B): A and B rows hold K, D rows N
    std::snprintf(buf, sizeof buf,
                  "%s: k=%lld must be a multiple of %lld and n=%lld of %lld (16-byte rows for TMA)", kname,
                  (long long)k, (long long)align_elems, (long long)n, (long long)align_n);
    return fail(kErrAlign, buf);
  }
  return kOk;
}

// The fp8 epilogue's scales (FsAgGemmArgs / FsGemmRsArgs scale_a, scale_b, scale_kind).
struct ScaleArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  int32_t kind = 0;
};

// The scaled (fp8) kernels need both scales; the 16-bit ones take none. kOk or a code with last_error set.
template <class Cfg>
int check_scales(const char* kname, ScaleArgs const& s) {
  char buf[512];
  if constexpr (Cfg::kScaled) {
    if (s.a == nullptr || s.b == nullptr) {
      std::snprintf(buf, sizeof buf,
                    "%s: fp8 kernels need scale_a and scale_b (fp32 device pointers; got %p, %p): pass a scale of "
                    "1.0 for an unscaled operand",
                    kname, s.a, s.b);
      return fail(kErrArgs, buf);
    }
    if ((s.kind & ~(kScaleRowwiseA | kScaleRowwiseB)) != 0) {
      std::snprintf(buf, sizeof buf, "%s: scale_kind=%d: use 0 or FS_SCALE_ROWWISE_A | FS_SCALE_ROWWISE_B", kname,
                    s.kind);
      return fail(kErrArgs, buf);
    }
  } else if (s.a != nullptr || s.b != nullptr || s.kind != 0) {
    return fail(kErrArgs, std::string(kname) + ": scale_a, scale_b and scale_kind are for the e4m3 kernels of the "
                                              "fp8 build; leave them 0 for 16-bit operands");
  }
  return kOk;
}

// Checks the K split of `args` against the kernel (pingpong kernels do not split) and K.
template <class Kernel>
int check_splits(const char* kname, typename Kernel::Arguments const& args) {
  char buf[512];
  constexpr int kMax = Kernel::TileScheduler::kMaxSplits;
  const int splits = args.scheduler.splits;
  const int k_tiles = fs::tiles_along(cute::get<2>(args.problem_shape),
                                      static_cast<int>(cute::size<2>(typename Kernel::TileShape{})));
  if (splits < 1 || splits > kMax) {
    std::snprintf(buf, sizeof buf, "%s: splits=%d but this kernel configuration takes 1 to %d%s", kname, splits, kMax,
                  kMax == 1 ? " (pingpong kernels do not split K: use a cooperative configuration)" : "");
    return fail(kErrArgs, buf);
  }
  if (args.scheduler.tail_chunks < 0) {
    std::snprintf(buf, sizeof buf, "%s: tail_chunks=%d must be >= 0 (0: ranges start at any K-tile)", kname,
                  args.scheduler.tail_chunks);
    return fail(kErrArgs, buf);
  }
  if (splits > k_tiles) {
    std::snprintf(buf, sizeof buf, "%s: splits=%d exceeds the %d K-tiles of k=%d: use at most %d splits", kname,
                  splits, k_tiles, cute::get<2>(args.problem_shape), k_tiles);
    return fail(kErrArgs, buf);
  }
  return kOk;
}

// Workspace bytes the kernel needs for `args` (0 unless K is split), or -1 with last_error set.
template <class Kernel>
int64_t workspace_bytes(const char* kname, int rc, typename Kernel::Arguments const& args) {
  if (rc == kOk) rc = check_splits<Kernel>(kname, args);
  if (rc != kOk) return -1;
  last_error().clear();
  return static_cast<int64_t>(Kernel::get_workspace_size(args));
}

// Fills `params_out` with Kernel::Params built from `args` and `launch` with the launch geometry. `workspace`
// (`workspace_bytes` bytes, 16-byte aligned, zeroed when allocated) is needed when K is split.
template <class Kernel>
int finish_params(const char* kname, typename Kernel::Arguments const& args, void* workspace,
                  uint64_t workspace_bytes, void* params_out, size_t params_cap, FsLaunch* launch) {
  char buf[512];
  if (params_out == nullptr || launch == nullptr) return fail(kErrArgs, std::string(kname) + ": null output pointer");
  if (int rc = check_splits<Kernel>(kname, args); rc != kOk) return rc;
  if (params_cap < sizeof(typename Kernel::Params)) {
    std::snprintf(buf, sizeof buf, "%s: params buffer holds %zu bytes, needs %zu", kname, params_cap,
                  sizeof(typename Kernel::Params));
    return fail(kErrCapacity, buf);
  }
  if (!Kernel::can_implement(args)) {
    std::snprintf(buf, sizeof buf,
                  "%s: CUTLASS can_implement() is false for m=%d n=%d k=%d (alignment or signal arguments)", kname,
                  cute::get<0>(args.problem_shape), cute::get<1>(args.problem_shape),
                  cute::get<2>(args.problem_shape));
    return fail(kErrCannotImplement, buf);
  }
  const size_t need = Kernel::get_workspace_size(args);
  if (need > 0 && (workspace == nullptr || workspace_bytes < need || !aligned16(workspace))) {
    std::snprintf(buf, sizeof buf,
                  "%s: splits=%d needs a zeroed, 16-byte aligned workspace of %zu bytes; got %p with %llu bytes "
                  "(CutlassGemm.launch allocates it)",
                  kname, args.scheduler.splits, need, workspace, (unsigned long long)workspace_bytes);
    return fail(kErrWorkspace, buf);
  }
  if (encode_tiled_fn() == nullptr) {
    return fail(kErrTma, std::string(kname) + ": cannot load cuTensorMapEncodeTiled from libcuda.so.1 (no NVIDIA "
                                              "driver on this machine?): TMA descriptors cannot be made");
  }
  tma_encode_status() = CUDA_SUCCESS;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, need > 0 ? workspace : nullptr);
  if (tma_encode_status() != CUDA_SUCCESS) {
    std::snprintf(buf, sizeof buf, "%s: cuTensorMapEncodeTiled failed (CUresult %d)%s", kname,
                  static_cast<int>(tma_encode_status()), " (bad address, stride or shape?)");
    return fail(kErrTma, buf);
  }
  std::memset(params_out, 0, params_cap < sizeof(params) ? params_cap : sizeof(params));
  std::memcpy(params_out, &params, sizeof(params));
  const dim3 grid = Kernel::get_grid_shape(params);
  const dim3 block = Kernel::get_block_shape();
  using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
  launch->grid[0] = grid.x;
  launch->grid[1] = grid.y;
  launch->grid[2] = grid.z;
  launch->block[0] = block.x;
  launch->block[1] = block.y;
  launch->block[2] = block.z;
  launch->cluster[0] = static_cast<uint32_t>(cute::size<0>(Cluster{}));
  launch->cluster[1] = static_cast<uint32_t>(cute::size<1>(Cluster{}));
  launch->cluster[2] = static_cast<uint32_t>(cute::size<2>(Cluster{}));
  launch->smem_bytes = static_cast<uint32_t>(Kernel::SharedStorageSize);
  last_error().clear();
  return kOk;
}

// Fills the mainloop/epilogue operand fields common to both families. `swizzle` (1, 2, 4, 8; checked by
// check_problem): the scheduler walks groups of swizzle clusters of M-tiles across N; `splits` (0 means 1; checked
// by finish_params): > 1 runs the last two waves as stream-K, in at most about `splits` pieces per tile
// (fs::plan_tail), its ranges starting at `tail_chunks` chunk boundaries per tile (0: at any K-tile; more than the
// tile's K-tiles counts as 0). The policy for both is the caller's (flux_shmem/kernels/config.py).
// The epilogue's fusion arguments: D = acc + bias[n] (16-bit), or the fp8 visitor tree (evt::ScaledAccBias), whose
// arguments nest as the tree does, children first: {scale_b, {scale_a, acc, multiply}, bias, multiply_add}.
template <class Cfg, class FusionArgs>
void fill_fusion(FusionArgs& t, const void* bias, ScaleArgs const& s) {
  using ElementD = typename Cfg::ElementD;
  if constexpr (Cfg::kScaled) {
    const bool row_a = (s.kind & kScaleRowwiseA) != 0, row_b = (s.kind & kScaleRowwiseB) != 0;
    t = FusionArgs{{static_cast<const float*>(s.b), 0.0f, {cute::_0{}, row_b, int64_t(0)}},
                   {{static_cast<const float*>(s.a), 0.0f, {row_a, cute::_0{}, int64_t(0)}}, {}, {}},
                   {static_cast<const ElementD*>(bias), ElementD(0), {}},
                   {}};
  } else {
    t.alpha = 1.0f;
    t.beta = 0.0f;
    t.bias_ptr = static_cast<const ElementD*>(bias);
  }
}

template <class Cfg, class Args>
void fill_operands(Args& args, int64_t m, int64_t n, int64_t k, const void* a, const void* b, void* d,
                   const void* bias, int32_t sm_count, int32_t device_id, const int32_t* m_tile_order,
                   int32_t swizzle, int32_t splits, int32_t tail_chunks, ScaleArgs const& scales = ScaleArgs{}) {
  using Kernel = typename Cfg::Kernel;
  using ElementA = typename Cfg::ElementA;
  using ElementB = typename Cfg::ElementB;
  using ElementD = typename Cfg::ElementD;
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = typename Cfg::ProblemShape{M, N, K, 1};
  args.mainloop.ptr_A = static_cast<const ElementA*>(a);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(M, K, 1));
  args.mainloop.ptr_B = static_cast<const ElementB*>(b);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(N, K, 1));
  fill_fusion<Cfg>(args.epilogue.thread, bias, scales);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, cute::make_shape(M, N, 1));
  args.epilogue.ptr_D = static_cast<ElementD*>(d);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(M, N, 1));
  args.hw_info.device_id = device_id;
  args.hw_info.sm_count = sm_count;
  args.hw_info.max_active_clusters = 0;
  args.scheduler.m_tile_order = m_tile_order;
  args.scheduler.max_swizzle_size = swizzle == 0 ? 1 : swizzle;
  args.scheduler.splits = splits == 0 ? 1 : splits;
  args.scheduler.tail_chunks = tail_chunks;
}

}  // namespace host
}  // namespace gemm
}  // namespace fs

// Driver shim: CUTLASS (with CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL) calls cuTensorMapEncodeTiled; this hidden
// definition forwards to libcuda.so.1, loaded on first use, and records the result for finish_params.
extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank, void* globalAddress,
    const cuuint64_t* globalDim, const cuuint64_t* globalStrides, const cuuint32_t* boxDim,
    const cuuint32_t* elementStrides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill) {
  fs::gemm::host::EncodeTiledFn fn = fs::gemm::host::encode_tiled_fn();
  CUresult r = fn == nullptr ? CUDA_ERROR_NOT_INITIALIZED
                             : fn(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides,
                                  boxDim, elementStrides, interleave, swizzle, l2Promotion, oobFill);
  if (r != CUDA_SUCCESS) fs::gemm::host::tma_encode_status() = r;
  return r;
}

// ABI introspection, so that the Python mirrors are checked field by field.
#define FS_ABI_FIELD(T, F)                                           \
  if (std::strcmp(type, #T) == 0 && std::strcmp(field, #F) == 0) { \
    return static_cast<int64_t>(offsetof(T, F));                     \
  }

extern "C" int64_t fs_abi_sizeof(const char* type) {
  if (type == nullptr) return -1;
  if (std::strcmp(type, "FsCtx") == 0) return sizeof(FsCtx);
  if (std::strcmp(type, "FsLaunch") == 0) return sizeof(FsLaunch);
  if (std::strcmp(type, "FsAgGemmArgs") == 0) return sizeof(FsAgGemmArgs);
  if (std::strcmp(type, "FsGemmRsArgs") == 0) return sizeof(FsGemmRsArgs);
  return -1;
}

extern "C" int64_t fs_abi_offsetof(const char* type, const char* field) {
  if (type == nullptr || field == nullptr) return -1;
  FS_ABI_FIELD(FsCtx, err)
  FS_ABI_FIELD(FsCtx, timeout_ns)
  FS_ABI_FIELD(FsCtx, my_pe)
  FS_ABI_FIELD(FsCtx, n_pes)
  FS_ABI_FIELD(FsCtx, trap_on_timeout)
  FS_ABI_FIELD(FsCtx, pad_)
  FS_ABI_FIELD(FsLaunch, grid)
  FS_ABI_FIELD(FsLaunch, block)
  FS_ABI_FIELD(FsLaunch, cluster)
  FS_ABI_FIELD(FsLaunch, smem_bytes)
  FS_ABI_FIELD(FsAgGemmArgs, m)
  FS_ABI_FIELD(FsAgGemmArgs, n)
  FS_ABI_FIELD(FsAgGemmArgs, k)
  FS_ABI_FIELD(FsAgGemmArgs, a)
  FS_ABI_FIELD(FsAgGemmArgs, b)
  FS_ABI_FIELD(FsAgGemmArgs, d)
  FS_ABI_FIELD(FsAgGemmArgs, bias)
  FS_ABI_FIELD(FsAgGemmArgs, sm_count)
  FS_ABI_FIELD(FsAgGemmArgs, device_id)
  FS_ABI_FIELD(FsAgGemmArgs, chunk_flags)
  FS_ABI_FIELD(FsAgGemmArgs, epoch)
  FS_ABI_FIELD(FsAgGemmArgs, rows_per_shard)
  FS_ABI_FIELD(FsAgGemmArgs, chunk_rows)
  FS_ABI_FIELD(FsAgGemmArgs, chunks_per_shard)
  FS_ABI_FIELD(FsAgGemmArgs, wait)
  FS_ABI_FIELD(FsAgGemmArgs, m_tile_order)
  FS_ABI_FIELD(FsAgGemmArgs, swizzle)
  FS_ABI_FIELD(FsAgGemmArgs, pad_)
  FS_ABI_FIELD(FsAgGemmArgs, ctx)
  FS_ABI_FIELD(FsAgGemmArgs, splits)
  FS_ABI_FIELD(FsAgGemmArgs, tail_chunks)
  FS_ABI_FIELD(FsAgGemmArgs, workspace)
  FS_ABI_FIELD(FsAgGemmArgs, workspace_bytes)
  FS_ABI_FIELD(FsAgGemmArgs, scale_a)
  FS_ABI_FIELD(FsAgGemmArgs, scale_b)
  FS_ABI_FIELD(FsAgGemmArgs, scale_kind)
  FS_ABI_FIELD(FsAgGemmArgs, pad2_)
  FS_ABI_FIELD(FsGemmRsArgs, m)
  FS_ABI_FIELD(FsGemmRsArgs, n)
  FS_ABI_FIELD(FsGemmRsArgs, k)
  FS_ABI_FIELD(FsGemmRsArgs, a)
  FS_ABI_FIELD(FsGemmRsArgs, b)
  FS_ABI_FIELD(FsGemmRsArgs, d)
  FS_ABI_FIELD(FsGemmRsArgs, bias)
  FS_ABI_FIELD(FsGemmRsArgs, sm_count)
  FS_ABI_FIELD(FsGemmRsArgs, device_id)
  FS_ABI_FIELD(FsGemmRsArgs, tile_ready)
  FS_ABI_FIELD(FsGemmRsArgs, epoch)
  FS_ABI_FIELD(FsGemmRsArgs, m_tile_order)
  FS_ABI_FIELD(FsGemmRsArgs, swizzle)
  FS_ABI_FIELD(FsGemmRsArgs, pad_)
  FS_ABI_FIELD(FsGemmRsArgs, ctx)
  FS_ABI_FIELD(FsGemmRsArgs, splits)
  FS_ABI_FIELD(FsGemmRsArgs, tail_chunks)
  FS_ABI_FIELD(FsGemmRsArgs, workspace)
  FS_ABI_FIELD(FsGemmRsArgs, workspace_bytes)
  FS_ABI_FIELD(FsGemmRsArgs, scale_a)
  FS_ABI_FIELD(FsGemmRsArgs, scale_b)
  FS_ABI_FIELD(FsGemmRsArgs, scale_kind)
  FS_ABI_FIELD(FsGemmRsArgs, pad2_)
  return -1;
}
#undef FS_ABI_FIELD

extern "C" const char* fs_gemm_last_error() { return fs::gemm::host::last_error().c_str(); }
extern "C" int32_t fs_gemm_tile_m() { return fs::gemm::kTileM; }
extern "C" int32_t fs_gemm_tile_n() { return fs::gemm::kTileN; }
extern "C" int32_t fs_gemm_cluster_m() { return static_cast<int32_t>(cute::size<0>(fs::gemm::ClusterShape{})); }
extern "C" int32_t fs_gemm_cluster_n() { return static_cast<int32_t>(cute::size<1>(fs::gemm::ClusterShape{})); }
extern "C" int32_t fs_gemm_pingpong() { return fs::gemm::kPingpong ? 1 : 0; }
extern "C" int32_t fs_gemm_tile_k() { return fs::gemm::kTileK; }
extern "C" int32_t fs_gemm_fp8() { return FS_GEMM_FP8 ? 1 : 0; }
extern "C" int32_t fs_gemm_fp8_fast_accum() { return FS_GEMM_FP8 && fs::gemm::kFp8FastAccum ? 1 : 0; }

#endif  // FS_HOST_PASS
