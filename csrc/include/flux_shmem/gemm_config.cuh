// The kernel types of one build: tile, cluster and schedule from the FS_GEMM_* macros of the configuration
// registry, operand types, GemmConfig, the kernel entry macros and FS_GEMM_BUILD_TYPES, the one list of a
// build's kernels that every family defines its kernels and host functions over.
// Part of gemm_ext.cuh (include that, not this file): it relies on what gemm_ext.cuh includes first.
#pragma once

namespace fs {
namespace gemm {

// ------------------------------------------------------------------------------------------------------------------
// Kernel configuration
// ------------------------------------------------------------------------------------------------------------------

template <class T>
using Identity = T;

// The configuration of every kernel of one build: a named entry of the registry (flux_shmem/kernels/registry.py),
// which passes these macros as -D flags (they are part of the build's cache key). Without them: the default entry.
//   FS_GEMM_TILE_M, FS_GEMM_TILE_N   CTA tile (cooperative) or consumer-warpgroup tile (pingpong)
//   FS_GEMM_CLUSTER_M, _N            CTAs per cluster
//   FS_GEMM_PINGPONG                 0: cooperative (both consumer warpgroups on one tile; run-time split-K)
//                                    1: pingpong (each consumer warpgroup on its own tile, epilogues overlapping
//                                       the other's mainloop; no split-K)
// and, from the build itself (flux_shmem/kernels/build.py), not the registry:
//   FS_GEMM_FP8                      1: the fp8 build (e4m3 A and B, scaled epilogue; ag_gemm.cu, gemm_rs.cu)
//   FS_GEMM_TILE_K                   K-tile: 64 (128 bytes of 16-bit operands), 128 in the fp8 build (128 bytes
//                                    of e4m3: the widest TMA/wgmma swizzle either way)
//   FS_GEMM_FP8_FAST_ACCUM           1: CUTLASS's FP8FastAccum schedules (wgmma accumulates straight into the
//                                    fp32 registers); 0 (default): its FP8 mainloop, which adds each K-tile's
//                                    wgmma results into separate fp32 accumulators (more accurate for long K, as
//                                    torch._scaled_mm's use_fast_accum=False)
#ifndef FS_GEMM_TILE_M
#define FS_GEMM_TILE_M 128
#endif
#ifndef FS_GEMM_TILE_N
#define FS_GEMM_TILE_N 256
#endif
#ifndef FS_GEMM_CLUSTER_M
#define FS_GEMM_CLUSTER_M 2
#endif
#ifndef FS_GEMM_CLUSTER_N
#define FS_GEMM_CLUSTER_N 1
#endif
#ifndef FS_GEMM_PINGPONG
#define FS_GEMM_PINGPONG 0
#endif
#ifndef FS_GEMM_FP8
#define FS_GEMM_FP8 0
#endif
#ifndef FS_GEMM_TILE_K
#if FS_GEMM_FP8
#define FS_GEMM_TILE_K 128
#else
#define FS_GEMM_TILE_K 64
#endif
#endif
#ifndef FS_GEMM_FP8_FAST_ACCUM
#define FS_GEMM_FP8_FAST_ACCUM 0
#endif
constexpr int kTileM = FS_GEMM_TILE_M;
constexpr int kTileN = FS_GEMM_TILE_N;
constexpr int kTileK = FS_GEMM_TILE_K;
constexpr bool kPingpong = FS_GEMM_PINGPONG != 0;
constexpr bool kFp8FastAccum = FS_GEMM_FP8_FAST_ACCUM != 0;
using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
using ClusterShape = cute::Shape<cute::Int<FS_GEMM_CLUSTER_M>, cute::Int<FS_GEMM_CLUSTER_N>, cute::_1>;

// Kernel and epilogue schedules of the two kernel kinds; the scheduler splits K only in the cooperative kernel.
// FastAccum picks CUTLASS's FP8FastAccum kernel schedule (fp8 operands only; the same kernel otherwise).
template <bool Pingpong, bool FastAccum = false>
struct ScheduleOf {
  using Kernel = cute::conditional_t<FastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                     cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = OrderedPersistentScheduler<true>;
};
template <bool FastAccum>
struct ScheduleOf<true, FastAccum> {
  using Kernel = cute::conditional_t<FastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                     cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = OrderedPersistentScheduler<false>;
};

// Operand types of a build. Element (cutlass::bfloat16_t, cutlass::half_t): A, B, D and bias alike, D = acc +
// bias[n] (CUTLASS's LinCombPerColBias). ScaledFp8<AB, D>: e4m3 A and B, D and bias of type D, the scaled
// epilogue above.
template <class ElementAB, class ElementD>
struct ScaledFp8 {};

// The fp8 builds' operands: e4m3 A and B, bf16 D (an alias, so that a macro argument can name it).
using E4m3ToBf16 = ScaledFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t>;

template <class Element>
struct OperandsOf {
  using A = Element;
  using B = Element;
  using D = Element;
  static constexpr bool kScaled = false;
  template <class Tile>
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<D, float, D, D, float>;
};
template <class AB, class D_>
struct OperandsOf<ScaledFp8<AB, D_>> {
  static_assert(cute::is_same_v<AB, cutlass::float_e4m3_t>, "fp8 builds take e4m3 operands");
  using A = AB;
  using B = AB;
  using D = D_;
  static constexpr bool kScaled = true;
  template <class Tile>
  using Fusion = evt::ScaledAccBias<Tile, D, D>;
};

// Element: cutlass::bfloat16_t, cutlass::half_t or ScaledFp8<cutlass::float_e4m3_t, D> (OperandsOf). BIsNK: B given
// as [N, K] row-major (K contiguous) rather than [K, N] row-major; fp8 needs "nk" (sm90 fp8 wgmma reads K-major
// operands only). A is [M, K] row-major, D [M, N] row-major, fp32 accumulation. MainloopExt / EpilogueExt wrap
// CUTLASS's collectives (AgMainloop, RsEpilogue or Identity).
template <class Element, bool BIsNK, template <class> class MainloopExt, template <class> class EpilogueExt,
          class Cluster = ClusterShape, class Tile = TileShape, bool Pingpong = kPingpong>
struct GemmConfig {
  using Operands = OperandsOf<Element>;
  using ElementA = typename Operands::A;
  using ElementB = typename Operands::B;
  using ElementD = typename Operands::D;
  using ElementAcc = float;
  static constexpr bool kScaled = Operands::kScaled;
  static_assert(!kScaled || BIsNK, "fp8 GEMMs take B as [N, K] (K-major): sm90 fp8 wgmma has no MN-major operands");
  using LayoutA = cutlass::layout::RowMajor;
  // CUTLASS's B is K x N: [N, K] row-major is K x N column-major; [K, N] row-major is K x N row-major.
  using LayoutB = cute::conditional_t<BIsNK, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Schedule = ScheduleOf<Pingpong, kScaled && kFp8FastAccum>;

  using FusionOp = typename Operands::template Fusion<Tile>;

  using EpilogueBase = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, typename Schedule::Epilogue, FusionOp>::CollectiveOp;
  using CollectiveEpilogue = EpilogueExt<EpilogueBase>;

  using MainloopBase = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignAB, ElementB, LayoutB, kAlignAB,
      ElementAcc, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using CollectiveMainloop = MainloopExt<MainloopBase>;

  using ProblemShape = cute::Shape<int, int, int, int>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue,
                                                      typename Schedule::Scheduler>;
  using Scheduler = typename Kernel::TileScheduler;
};

static_assert(cute::size<0>(TileShape{}) == kTileM && cute::size<1>(TileShape{}) == kTileN &&
                  cute::size<2>(TileShape{}) == kTileK,
              "fs_gemm_tile_m/n/k report kTileM/kTileN/kTileK");

}  // namespace gemm
}  // namespace fs

// Kernel entry: one by-value parameter, the CUTLASS kernel's Params. Empty body in the host pass.
#if defined(FS_DEVICE_PASS)
#define FS_GEMM_KERNEL_BODY(Kernel) \
  {                                 \
    extern __shared__ char smem[];  \
    Kernel op;                      \
    op(params, smem);               \
  }
#else
#define FS_GEMM_KERNEL_BODY(Kernel) \
  { (void)params; }
#endif

#define FS_DEFINE_GEMM_KERNEL(name, Kernel)                                                                  \
  extern "C" __global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor) \
      name(const __grid_constant__ Kernel::Params params) FS_GEMM_KERNEL_BODY(Kernel)

// The kernels of one build, as X(dt, bl, Element, BIsNK): dt and bl name the kernel (fs_<family>_<dt>_<bl>) and
// its host functions, Element and BIsNK are GemmConfig's. Both families define theirs over this one list. The fp8
// build holds e4m3 with B [N, K] only (sm90 fp8 wgmma reads K-major operands); the 16-bit build both dtypes and
// both B layouts.
#if FS_GEMM_FP8
#define FS_GEMM_BUILD_TYPES(X) X(e4m3, nk, ::fs::gemm::E4m3ToBf16, true)
#else
#define FS_GEMM_BUILD_TYPES(X)                                                                                        \
  X(bf16, kn, cutlass::bfloat16_t, false)                                                                             \
  X(bf16, nk, cutlass::bfloat16_t, true)                                                                              \
  X(fp16, kn, cutlass::half_t, false)                                                                                 \
  X(fp16, nk, cutlass::half_t, true)
#endif
