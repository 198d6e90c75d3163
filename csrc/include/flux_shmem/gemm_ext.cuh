// CUTLASS extensions shared by the GEMM families (ag_gemm.cu, gemm_rs.cu), written against CUTLASS 4.2's sm90
// extension points:
//   * OrderedTileScheduler: a persistent tile scheduler (wraps PersistentTileSchedulerSm90) that visits M-tiles in
//     the order of a device array and rasters along N; plugged in with the tag OrderedPersistentScheduler through a
//     specialization of cutlass::gemm::kernel::detail::TileSchedulerSelector.
//   * AgMainloop<Base>: the sm90 TMA warp-specialized mainloop whose producer first waits for the all-gather chunks
//     covering the tile's rows.
//   * RsEpilogue<Base>: the sm90 TMA warp-specialized epilogue that, before its first store, waits for its peers'
//     arrival slots, and after each tile raises the tile row's rows_ready counter.
//   * GemmConfig<...>: the kernel types (128x256x64 cooperative, cluster 2x1x1, D = acc + bias[n]).
//   * host helpers (FS_HOST_PASS only): error string, ABI introspection, the TMA-descriptor driver shim and the
//     generic "fill Params + launch geometry" routine.
//
// Device side code only uses plain loads/stores on signal words (no NVSHMEM).
#pragma once

#if defined(FS_HOST_PASS) && !defined(CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL)
// TMA descriptors are encoded on the host through cuTensorMapEncodeTiled. Call it "directly" and resolve it from
// libcuda.so.1 at run time (see the shim at the end of this file): the host library then loads without a driver
// (CPU-only CI) and never initialises a CUDA runtime of its own.
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#endif

#include <cstddef>
#include <cstdint>

#include <cuda.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/arch/barrier.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "flux_shmem/gemm_abi.h"
#include "flux_shmem/signal.cuh"
#include "flux_shmem/tile_schedule.cuh"

static_assert(sizeof(fs::Ctx) == sizeof(FsCtx), "FsCtx must mirror fs::Ctx");
static_assert(offsetof(fs::Ctx, err) == offsetof(FsCtx, err), "FsCtx must mirror fs::Ctx");
static_assert(offsetof(fs::Ctx, timeout_ns) == offsetof(FsCtx, timeout_ns), "FsCtx must mirror fs::Ctx");
static_assert(offsetof(fs::Ctx, my_pe) == offsetof(FsCtx, my_pe), "FsCtx must mirror fs::Ctx");
static_assert(offsetof(fs::Ctx, n_pes) == offsetof(FsCtx, n_pes), "FsCtx must mirror fs::Ctx");
static_assert(offsetof(fs::Ctx, trap_on_timeout) == offsetof(FsCtx, trap_on_timeout), "FsCtx must mirror fs::Ctx");

namespace fs {
namespace gemm {

// ------------------------------------------------------------------------------------------------------------------
// Memory-model helpers
// ------------------------------------------------------------------------------------------------------------------

// Orders this thread's prior generic-proxy accesses (e.g. an acquire of a flag) with its later async-proxy accesses
// to global memory (TMA loads/stores), and vice versa.
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

// Waits until every bulk async-group committed by this thread is complete, writes included (cute's tma_store_wait
// only waits for the reads of shared memory).
__device__ __forceinline__ void bulk_wait_all_complete() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

// ------------------------------------------------------------------------------------------------------------------
// Ordered persistent tile scheduler
// ------------------------------------------------------------------------------------------------------------------

// Scheduler tag: pass as the 4th template argument of cutlass::gemm::kernel::GemmUniversal.
struct OrderedPersistentScheduler {};

// A static persistent scheduler (the kernel sees PersistentTileSchedulerSm90's interface) that walks the work
// tiles in its own order, with no padding: cluster c of C takes work items c, c + C, c + 2C, ... of
// pairs * tiles_n items, pairs = ceil(tiles_m / cluster_m). Item w belongs to swizzle group g = w / (S * tiles_n)
// (S cluster rows of M-tiles, fewer in the last group), walked along N: n = (w - g*S*tiles_n) / S_g, row = g*S +
// (w - g*S*tiles_n) % S_g. CTA i of a cluster takes M-tile order entry row * cluster_m + i (m_tile_order: a
// permutation of [0, tiles_m); null = identity); an entry past tiles_m (odd tiles_m) is padding inside a real
// cluster tile and CUTLASS predicates it away. CUTLASS's own scheduler rounds both tile counts up to multiples of
// the swizzle and runs the padding tiles in full (zeros through the whole mainloop): up to 3/8 of a wave for
// N = 1280 at swizzle 8. flux_shmem/ops/simulate.py gemm_work mirrors this mapping.
class OrderedTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrder = typename Base::RasterOrder;
  using RasterOrderOptions = typename Base::RasterOrderOptions;

  struct Arguments : Base::Arguments {
    const int32_t* m_tile_order = nullptr;
  };

  struct Params : Base::Params {
    const int32_t* m_tile_order = nullptr;
    int32_t tiles_m = 0;
    int32_t tiles_n = 0;
    int32_t pairs = 0;        // cluster rows of M-tiles
    int32_t swizzle = 1;      // cluster rows per group
    int32_t cluster_m = 1;
    int32_t pad_ = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    typename Base::Arguments base_args;
    base_args.max_swizzle_size = 1;
    base_args.raster_order = RasterOrderOptions::AlongN;
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base_args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    p.m_tile_order = args.m_tile_order;
    p.tiles_m = fs::tiles_along(static_cast<long long>(cute::get<0>(problem_shape_mnkl)),
                                static_cast<int>(cute::size<0>(tile_shape)));
    p.tiles_n = fs::tiles_along(static_cast<long long>(cute::get<1>(problem_shape_mnkl)),
                                static_cast<int>(cute::size<1>(tile_shape)));
    p.cluster_m = static_cast<int32_t>(cute::size<0>(cluster_shape));
    p.pairs = (p.tiles_m + p.cluster_m - 1) / p.cluster_m;
    p.swizzle = args.max_swizzle_size < 1 ? 1 : (args.max_swizzle_size > p.pairs ? p.pairs : args.max_swizzle_size);
    if (p.swizzle < 1) p.swizzle = 1;
    return p;
  }

  // Launch grid (cluster_m, clusters, 1): one cluster per cluster_m of the sm_count SMs given, at most one per item.
  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  CUTLASS_HOST_DEVICE static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL, BlockShape, ClusterShape,
                                                 cutlass::KernelHardwareInfo hw_info,
                                                 typename Base::Arguments = typename Base::Arguments{},
                                                 bool = true) {
    const long long items = static_cast<long long>(params.pairs) * params.tiles_n;
    long long clusters = hw_info.sm_count / params.cluster_m;
    if (clusters > items) clusters = items;
    if (clusters < 1) clusters = 1;
    return dim3(static_cast<uint32_t>(params.cluster_m), static_cast<uint32_t>(clusters), 1);
  }

  CUTLASS_HOST_DEVICE OrderedTileScheduler() {}

  CUTLASS_DEVICE explicit OrderedTileScheduler(Params const& params) : Base(params), p_(&params) {
#if defined(__CUDA_ARCH__)
    work_ = blockIdx.y;
    stride_ = gridDim.y;
    cta_m_ = static_cast<int32_t>(blockIdx.x);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) { return current(); }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return current(); }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {  // whole tiles only: never continue the current one
    work_ += stride_;
    return cute::make_tuple(current(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo current() const {
    const Params& p = *p_;
    const long long items = static_cast<long long>(p.pairs) * p.tiles_n;
    if (work_ >= static_cast<unsigned long long>(items)) return WorkTileInfo::invalid_work_tile();
    const long long w = static_cast<long long>(work_);
    const long long group_items = static_cast<long long>(p.swizzle) * p.tiles_n;
    const int g = static_cast<int>(w / group_items);
    const int first = g * p.swizzle;
    const int rows = p.pairs - first < p.swizzle ? p.pairs - first : p.swizzle;
    const int idx = static_cast<int>(w - g * group_items);
    WorkTileInfo t;
    t.N_idx = idx / rows;
    t.M_idx = (first + idx % rows) * p.cluster_m + cta_m_;
    t.L_idx = 0;
    t.is_valid_tile = true;
    if (p.m_tile_order != nullptr && t.M_idx < p.tiles_m) t.M_idx = __ldg(p.m_tile_order + t.M_idx);
    return t;
  }

  Params const* p_ = nullptr;
  unsigned long long work_ = 0;
  unsigned long long stride_ = 1;
  int32_t cta_m_ = 0;
};

}  // namespace gemm
}  // namespace fs

// CUTLASS's extension point: GemmUniversal<..., fs::gemm::OrderedPersistentScheduler> picks OrderedTileScheduler.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<fs::gemm::OrderedPersistentScheduler, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = fs::gemm::OrderedTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

namespace fs {
namespace gemm {

// ------------------------------------------------------------------------------------------------------------------
// AllGather mainloop: wait for the gathered rows, then the usual TMA producer
// ------------------------------------------------------------------------------------------------------------------

template <class Base_>
struct AgMainloop : Base_ {
  using Base = Base_;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static constexpr int kTileM = static_cast<int>(cute::size<0>(TileShape{}));

  struct Arguments : Base::Arguments {
    const uint64_t* chunk_flags = nullptr;
    const uint64_t* epoch = nullptr;
    int32_t rows_per_shard = 0;
    int32_t chunk_rows = 0;
    int32_t chunks_per_shard = 0;
    int32_t wait = 0;
    fs::Ctx ctx{};
  };

  struct Params : Base::Params {
    const uint64_t* chunk_flags = nullptr;
    const uint64_t* epoch = nullptr;
    int64_t m = 0;
    int32_t rows_per_shard = 0;
    int32_t chunk_rows = 0;
    int32_t chunks_per_shard = 0;
    int32_t wait = 0;
    fs::Ctx ctx{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.chunk_flags = args.chunk_flags;
    p.epoch = args.epoch;
    p.m = static_cast<int64_t>(cute::get<0>(problem_shape));
    p.rows_per_shard = args.rows_per_shard;
    p.chunk_rows = args.chunk_rows;
    p.chunks_per_shard = args.chunks_per_shard;
    p.wait = args.wait;
    p.ctx = args.ctx;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    if (!Base::can_implement(problem_shape, args)) return false;
    if (!args.wait) return true;
    return args.chunk_flags != nullptr && args.epoch != nullptr && args.rows_per_shard > 0 && args.chunk_rows > 0 &&
           args.chunks_per_shard == fs::ceil_div_int(args.rows_per_shard, args.chunk_rows);
  }

  // Producer (one warp): one elected lane waits for the chunks of this tile's rows, the warp syncs, then the base
  // collective issues the TMA loads.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    if (params.wait) {
      if (cute::elect_one_sync()) {
        wait_tile_rows(params, static_cast<int>(cute::get<0>(blk_coord)));
      }
      __syncwarp();
      fence_proxy_async_global();  // the flags were acquired by the generic proxy; A is read by TMA
    }
    Base::load(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count, thread_idx,
               block_rank_in_cluster, shared_tensors);
  }

 private:
  CUTLASS_DEVICE void wait_tile_rows(Params const& params, int m_tile) {
    if (!epoch_loaded_) {
      epoch_target_ = ld_volatile_u64(params.epoch);
      epoch_loaded_ = true;
    }
    const fs::ChunkSpan span =
        fs::chunk_span_for_tile(m_tile, kTileM, params.m, params.rows_per_shard, params.chunk_rows);
    const int count = fs::chunk_span_count(span, params.chunks_per_shard);
    if (count == 0) return;
    const int lo = fs::chunk_span_flag(span, params.chunks_per_shard, 0);
    const int hi = lo + count - 1;
    if (lo >= ready_lo_ && hi <= ready_hi_) return;  // flags only grow within a kernel: seen ready stays ready
    const fs::Ctx ctx = params.ctx;  // a local copy for wait_ge (its out-of-line report takes it by reference)
    for (int f = lo; f <= hi; ++f) {
      if (f >= ready_lo_ && f <= ready_hi_) continue;
      fs::wait_ge(ctx, params.chunk_flags + f, epoch_target_, fs::kSiteChunk, f);
    }
    ready_lo_ = lo;
    ready_hi_ = hi;
  }

  uint64_t epoch_target_ = 0;
  bool epoch_loaded_ = false;
  int ready_lo_ = 0;
  int ready_hi_ = -1;
};

// ------------------------------------------------------------------------------------------------------------------
// ReduceScatter epilogue: wait for the peers once, then raise rows_ready[m_tile] after each tile's stores land
// ------------------------------------------------------------------------------------------------------------------

template <class Base_>
class RsEpilogue : public Base_ {
 public:
  using Base = Base_;
  using typename Base::LoadPipeline;
  using typename Base::LoadPipelineState;
  using typename Base::StorePipeline;
  using typename Base::StorePipelineState;
  using typename Base::TensorStorage;
  using typename Base::CtaTileMNK;
  static constexpr int kTileM = static_cast<int>(cute::size<0>(CtaTileMNK{}));
  static constexpr int kTileN = static_cast<int>(cute::size<1>(CtaTileMNK{}));
  // Named barrier among the consumer threads (user id; CUTLASS's cooperative kernel uses no user barrier).
  static constexpr uint32_t kPeerBarrierId = 3;

  struct Arguments : Base::Arguments {
    uint64_t* rows_ready = nullptr;
    const uint64_t* bar = nullptr;
    int32_t group_first = 0;
    int32_t group_size = 0;
    const uint64_t* epoch = nullptr;
    fs::Ctx ctx{};
  };

  struct Params : Base::Params {
    uint64_t* rows_ready = nullptr;
    const uint64_t* bar = nullptr;
    int32_t group_first = 0;
    int32_t group_size = 0;
    const uint64_t* epoch = nullptr;
    int32_t tiles_m = 0;
    int32_t tiles_n = 0;
    fs::Ctx ctx{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.rows_ready = args.rows_ready;
    p.bar = args.bar;
    p.group_first = args.group_first;
    p.group_size = args.group_size;
    p.epoch = args.epoch;
    p.tiles_m = fs::tiles_along(static_cast<long long>(cute::get<0>(problem_shape)), kTileM);
    p.tiles_n = fs::tiles_along(static_cast<long long>(cute::get<1>(problem_shape)), kTileN);
    p.ctx = args.ctx;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    if (!Base::can_implement(problem_shape, args)) return false;
    if (args.rows_ready == nullptr) return true;
    return args.epoch != nullptr && args.group_size >= 0 && args.group_first >= 0 &&
           (args.group_size == 0 || args.bar != nullptr);
  }

  CUTLASS_HOST_DEVICE RsEpilogue(Params const& params, TensorStorage& shared_tensors)
      : Base(params, shared_tensors), ext_(&params) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_pipe_consumer_state,
                            StorePipeline store_pipeline, StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& shared_tensors,
                            int subtile_idx = -1) {
    Params const& p = *ext_;
    const bool signal = p.rows_ready != nullptr;
    if (signal && !peers_waited_) {
      // The previous call's readers of D must be done: wait for the group's arrival slots, once per kernel.
      if (thread_idx == 0) {
        const uint64_t target = ld_volatile_u64(p.epoch);
        const fs::Ctx ctx = p.ctx;  // local copy, as in AgMainloop::wait_tile_rows
        for (int q = p.group_first; q < p.group_first + p.group_size; ++q) {
          fs::wait_ge(ctx, p.bar + q, target, fs::kSiteBarrier, q);
        }
        fence_proxy_async_global();  // D is written by TMA (async proxy) after this generic acquire
      }
      cutlass::arch::NamedBarrier::sync(static_cast<uint32_t>(cute::size(TiledMma{})), kPeerBarrierId);
      peers_waited_ = true;
    }

    auto next = Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                            problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                            shared_tensors, subtile_idx);

    if (signal) {
      // The base epilogue issues every TMA store of the tile from the consumer threads 0..31 (one warp); each of
      // them waits for its own bulk groups to be complete (writes included), then lane 0 publishes the tile.
      if (thread_idx < cutlass::NumThreadsPerWarp) {
        bulk_wait_all_complete();
        fence_proxy_async_global();
        __threadfence_system();
        __syncwarp();
        if (thread_idx == 0) {
          const int m_tile = static_cast<int>(cute::get<0>(tile_coord_mnkl));
          const int n_tile = static_cast<int>(cute::get<1>(tile_coord_mnkl));
          if (m_tile >= 0 && m_tile < p.tiles_m && n_tile >= 0 && n_tile < p.tiles_n) {
            fs::red_add_release_sys(p.rows_ready + m_tile, 1ull);
          }
        }
      }
    }
    return next;
  }

 private:
  Params const* ext_;
  bool peers_waited_ = false;
};

// ------------------------------------------------------------------------------------------------------------------
// Kernel configuration
// ------------------------------------------------------------------------------------------------------------------

template <class T>
using Identity = T;

// Tile and cluster shape of every kernel of a build. Tuning knobs: the build takes -D overrides from
// FLUX_SHMEM_BUILD_DEFINES (part of the cache key), e.g. "FS_GEMM_TILE_M=256 FS_GEMM_TILE_N=128".
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
constexpr int kTileM = FS_GEMM_TILE_M;
constexpr int kTileN = FS_GEMM_TILE_N;
using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_64>;
using ClusterShape = cute::Shape<cute::Int<FS_GEMM_CLUSTER_M>, cute::Int<FS_GEMM_CLUSTER_N>, cute::_1>;

// Element: cutlass::bfloat16_t or cutlass::half_t. BIsNK: B given as [N, K] row-major (K contiguous) rather than
// [K, N] row-major. A is [M, K] row-major, D [M, N] row-major, fp32 accumulation, D = acc + bias[n] (bias optional).
template <class Element, bool BIsNK, template <class> class MainloopExt, template <class> class EpilogueExt,
          class Cluster = ClusterShape, class Tile = TileShape>
struct GemmConfig {
  using ElementA = Element;
  using ElementB = Element;
  using ElementD = Element;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;
  // CUTLASS's B is K x N: [N, K] row-major is K x N column-major; [K, N] row-major is K x N row-major.
  using LayoutB = cute::conditional_t<BIsNK, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;

  using FusionOp = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, Element, Element, float>;

  using EpilogueBase = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlign, ElementD, LayoutD,
      kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative, FusionOp>::CollectiveOp;
  using CollectiveEpilogue = EpilogueExt<EpilogueBase>;

  using MainloopBase = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB, LayoutB, kAlign,
      ElementAcc, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using CollectiveMainloop = MainloopExt<MainloopBase>;

  using ProblemShape = cute::Shape<int, int, int, int>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue,
                                                      OrderedPersistentScheduler>;
};

static_assert(cute::size<0>(TileShape{}) == kTileM && cute::size<1>(TileShape{}) == kTileN,
              "fs_gemm_tile_m/n report kTileM/kTileN");

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
  kErrWorkspace = 5,    // the kernel would need a workspace (never with this configuration)
  kErrTma = 6,          // cuTensorMapEncodeTiled failed (no driver, bad address, ...)
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline fs::Ctx to_ctx(const FsCtx& c) {
  fs::Ctx ctx;
  std::memcpy(&ctx, &c, sizeof(ctx));
  return ctx;
}

// Common checks of the problem; returns kOk or a code with last_error set.
inline int check_problem(const char* kname, int64_t m, int64_t n, int64_t k, const void* a, const void* b,
                         const void* d, const void* bias, int32_t sm_count, int32_t swizzle, size_t elem_bytes) {
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
  if (n % align_elems != 0 || k % align_elems != 0) {
    std::snprintf(buf, sizeof buf,
                  "%s: n=%lld and k=%lld must be multiples of %lld (16-byte rows for TMA)", kname, (long long)n,
                  (long long)k, (long long)align_elems);
    return fail(kErrAlign, buf);
  }
  return kOk;
}

// Fills `params_out` with Kernel::Params built from `args` and `launch` with the launch geometry.
template <class Kernel>
int finish_params(const char* kname, typename Kernel::Arguments const& args, void* params_out, size_t params_cap,
                  FsLaunch* launch) {
  char buf[512];
  if (params_out == nullptr || launch == nullptr) return fail(kErrArgs, std::string(kname) + ": null output pointer");
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
  if (Kernel::get_workspace_size(args) != 0) {
    return fail(kErrWorkspace, std::string(kname) + ": the kernel asks for a workspace (unsupported)");
  }
  if (encode_tiled_fn() == nullptr) {
    return fail(kErrTma, std::string(kname) + ": cannot load cuTensorMapEncodeTiled from libcuda.so.1 (no NVIDIA "
                                              "driver on this machine?): TMA descriptors cannot be made");
  }
  tma_encode_status() = CUDA_SUCCESS;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
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
// check_problem): the scheduler walks groups of swizzle clusters of M-tiles across N (the policy is the caller's:
// flux_shmem/kernels/gemm.py swizzle_for).
template <class Cfg, class Args>
void fill_operands(Args& args, int64_t m, int64_t n, int64_t k, const void* a, const void* b, void* d,
                   const void* bias, int32_t sm_count, int32_t device_id, const int32_t* m_tile_order,
                   int32_t swizzle) {
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
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.bias_ptr = static_cast<const ElementD*>(bias);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, cute::make_shape(M, N, 1));
  args.epilogue.ptr_D = static_cast<ElementD*>(d);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(M, N, 1));
  args.hw_info.device_id = device_id;
  args.hw_info.sm_count = sm_count;
  args.hw_info.max_active_clusters = 0;
  args.scheduler.m_tile_order = m_tile_order;
  args.scheduler.max_swizzle_size = swizzle == 0 ? 1 : swizzle;
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
  FS_ABI_FIELD(FsGemmRsArgs, m)
  FS_ABI_FIELD(FsGemmRsArgs, n)
  FS_ABI_FIELD(FsGemmRsArgs, k)
  FS_ABI_FIELD(FsGemmRsArgs, a)
  FS_ABI_FIELD(FsGemmRsArgs, b)
  FS_ABI_FIELD(FsGemmRsArgs, d)
  FS_ABI_FIELD(FsGemmRsArgs, bias)
  FS_ABI_FIELD(FsGemmRsArgs, sm_count)
  FS_ABI_FIELD(FsGemmRsArgs, device_id)
  FS_ABI_FIELD(FsGemmRsArgs, rows_ready)
  FS_ABI_FIELD(FsGemmRsArgs, bar)
  FS_ABI_FIELD(FsGemmRsArgs, group_first)
  FS_ABI_FIELD(FsGemmRsArgs, group_size)
  FS_ABI_FIELD(FsGemmRsArgs, epoch)
  FS_ABI_FIELD(FsGemmRsArgs, m_tile_order)
  FS_ABI_FIELD(FsGemmRsArgs, swizzle)
  FS_ABI_FIELD(FsGemmRsArgs, pad_)
  FS_ABI_FIELD(FsGemmRsArgs, ctx)
  return -1;
}
#undef FS_ABI_FIELD

extern "C" const char* fs_gemm_last_error() { return fs::gemm::host::last_error().c_str(); }
extern "C" int32_t fs_gemm_tile_m() { return fs::gemm::kTileM; }
extern "C" int32_t fs_gemm_tile_n() { return fs::gemm::kTileN; }
extern "C" int32_t fs_gemm_cluster_m() { return static_cast<int32_t>(cute::size<0>(fs::gemm::ClusterShape{})); }
extern "C" int32_t fs_gemm_cluster_n() { return static_cast<int32_t>(cute::size<1>(fs::gemm::ClusterShape{})); }

#endif  // FS_HOST_PASS
