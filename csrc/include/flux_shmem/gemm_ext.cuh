// CUTLASS extensions shared by the GEMM families (ag_gemm.cu, gemm_rs.cu), written against CUTLASS 4.2's sm90
// extension points:
//   * OrderedTileScheduler: a persistent tile scheduler (extends PersistentTileSchedulerSm90) that visits M-tiles in
//     the order of a device array, rasters along N with swizzle groups but no padding tiles, and splits K at run
//     time (cooperative kernels); plugged in with the tag OrderedPersistentScheduler<split_k> through a
//     specialization of cutlass::gemm::kernel::detail::TileSchedulerSelector.
//   * AgMainloop<Base>: the sm90 TMA warp-specialized mainloop whose producer first waits for the all-gather chunks
//     covering the tile's rows.
//   * RsEpilogue<Base>: the sm90 TMA warp-specialized epilogue that marks each tile ready (its word in tile_ready
//     set to the epoch) once the tile's stores have landed.
//   * GemmConfig<...>: the kernel types of one build (tile, cluster and cooperative or pingpong schedule from the
//     FS_GEMM_* macros set by the configuration registry, flux_shmem/kernels/registry.py; D = acc + bias[n]).
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

// Programmatic dependent launch (PDL): CUTLASS's sm90 kernels then wait (griddepcontrol.wait) before their first
// global loads and let the next kernel launch at their last tile. Without the launch attribute both are no-ops;
// flux_shmem/kernels/gemm.py sets it on plain GEMMs when FLUX_SHMEM_GEMM_PDL=1, so a GEMM's start (grid launch,
// barrier init, descriptor prefetch) overlaps the previous kernel's tail. Our extensions read global memory only
// after that wait (the chunk waits run in the mainloop producer, the split-K fixup and the epilogue's waits after
// the mainloop), except the scheduler's m_tile_order, a table written at plan time.
#ifndef CUTLASS_ENABLE_GDC_FOR_SM90
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#endif

#include <cstddef>
#include <cstdint>

#include <cuda.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/arch/barrier.h"
#include "cutlass/barrier.h"
#include "cutlass/block_striped.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "flux_shmem/gemm_abi.h"
#include "flux_shmem/gemm_schedule.cuh"
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

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

// ------------------------------------------------------------------------------------------------------------------
// Ordered persistent tile scheduler, with optional split-K
// ------------------------------------------------------------------------------------------------------------------

// Scheduler tag: pass as the 4th template argument of cutlass::gemm::kernel::GemmUniversal. kSplitK: the kernel can
// split K at run time (Arguments::splits); only the cooperative kernel calls the scheduler's fixup, so pingpong
// kernels take kSplitK = false.
template <bool kSplitK>
struct OrderedPersistentScheduler {};

// A persistent tile scheduler (CUTLASS's PersistentTileSchedulerSm90 extended) that
//   * numbers work units as fs::unit_at (gemm_schedule.cuh): raster along N, swizzle groups of `max_swizzle_size`
//     clusters along M, no padding tiles beyond whole clusters;
//   * maps the M index of every work tile through m_tile_order (a permutation of [0, tiles_m); null = identity).
//     The CTAs of a cluster of C CTAs along M take order[C*i .. C*i+C-1] at the same N-tile; when tiles_m is not a
//     multiple of C the padding M-tiles (index >= tiles_m) are not mapped and fall outside the problem (CUTLASS
//     predicates them away, the epilogue raises no counter for them);
//   * with kSplitK and splits > 1, runs the last partial wave and the whole wave before it as stream-K (an even
//     share of their K-tiles per cluster; fs::plan_tail, fs::unit_at), reduces the pieces of a split tile in a
//     workspace (fp32 partials + one lock per split tile and consumer warpgroup) in reduction order
//     (deterministic), and lets only the last piece run the epilogue. The last piece resets its lock to 0, so the
//     workspace needs zeroing once, when allocated, not per launch (launches of one stream do not overlap;
//     CUDA-graph replays stay correct). The locks live in a region of
//     fixed size at the start of the workspace that partials never touch: a workspace shared by launches of
//     other shapes then still holds zero locks (with the locks placed after the shape's partials, a later shape's
//     locks fell on an earlier shape's fp32 partials and its splits waited forever: seen 2026-12-04, 2 PEs).
template <class TileShape, class ClusterShape, bool kSplitK>
class OrderedTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static constexpr int kTileM = static_cast<int>(cute::size<0>(TileShape{}));
  static constexpr int kTileN = static_cast<int>(cute::size<1>(TileShape{}));
  static constexpr int kTileK = static_cast<int>(cute::size<2>(TileShape{}));
  static constexpr int kClusterM = static_cast<int>(cute::size<0>(ClusterShape{}));
  static constexpr int kClusterN = static_cast<int>(cute::size<1>(ClusterShape{}));
  // Named barriers of the split-K reduction: CUTLASS's stream-K ids (one per consumer warpgroup).
  static constexpr uint32_t kReduceBarrier0 =
      static_cast<uint32_t>(cutlass::arch::ReservedNamedBarriers::StreamkBarrier0);
  using ReduceBarrier = cutlass::NamedBarrierManager<cutlass::NumThreadsPerWarpGroup, kReduceBarrier0, 2>;
  using Lock = typename ReduceBarrier::T;
  static_assert(sizeof(Lock) == 4, "split-K locks are 32-bit words (wait_lock loads them so)");

 public:
  static constexpr int kMaxSplits = kSplitK ? 16 : 1;
  using RasterOrder = typename Base::RasterOrder;
  using RasterOrderOptions = typename Base::RasterOrderOptions;

  struct WorkTileInfo {
    int32_t M_idx = 0;
    int32_t N_idx = 0;
    int32_t L_idx = 0;
    bool is_valid_tile = false;
    int32_t split = 0;    // this unit's K split, 0 .. splits-1
    int32_t splits = 1;   // K splits of this tile (1: whole)
    int32_t k_start = 0;
    int32_t k_count = 0;
    int32_t slot = -1;    // the CTA tile's reduction slot when split

    CUTLASS_HOST_DEVICE bool is_valid() const { return is_valid_tile; }
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return {-1, -1, -1, false, 0, 1, 0, 0, -1}; }
    CUTLASS_HOST_DEVICE int32_t reduction_subtile_idx() const { return -1; }  // no separate reduction units
  };

  struct Arguments : Base::Arguments {
    const int32_t* m_tile_order = nullptr;
    int32_t splits = 1;
    int32_t tail_chunks = 0;  // the tail's ranges start only at this many chunk boundaries per tile (0: any K-tile)
    fs::Ctx ctx{};  // timeout and error slot of the split-K lock waits (timeout_ns 0: wait without one)
  };

  struct Params : Base::Params {
    fs::Ctx ctx{};
    const int32_t* m_tile_order = nullptr;
    fs::UnitGrid grid{};
    int64_t units = 0;
    int32_t tiles_m = 0;
    int32_t pad_ = 0;
    void* reduction = nullptr;   // fp32 partials, one kTileM x kTileN tile per split CTA tile
    Lock* locks = nullptr;       // one per split CTA tile and consumer warpgroup, zero between launches
  };

  // Bytes at the start of the workspace for the locks, whatever the shape: split CTA tiles are fewer than the
  // persistent grid's CTAs (one per SM at most), and 2 consumer warpgroups x 4 bytes x 8192 CTAs fit.
  static constexpr size_t kLockRegionBytes = 64 * 1024;

  // Persistent clusters on hw_info.sm_count SMs (CUTLASS's rule, which the launch grid follows).
  static int64_t persistent_clusters(cutlass::KernelHardwareInfo const& hw_info) {
    const dim3 all{static_cast<uint32_t>(1u << 20), 1u, 1u};  // problem size does not truncate this grid
    const dim3 grid = Base::Params::get_grid_shape(all, cutlass::gemm::GemmCoord(kClusterM, kClusterN, 1), hw_info, 1,
                                                   RasterOrderOptions::AlongN, /*truncate_by_problem_size=*/false);
    return static_cast<int64_t>(grid.x) * grid.y * grid.z / (kClusterM * kClusterN);
  }

  static fs::UnitGrid unit_grid(int64_t m, int64_t n, int64_t k, int swizzle, int splits, int chunks,
                                cutlass::KernelHardwareInfo const& hw_info) {
    fs::UnitGrid g;
    g.clusters_m = fs::ceil_div_int(fs::tiles_along(m, kTileM), kClusterM);
    g.clusters_n = fs::ceil_div_int(fs::tiles_along(n, kTileN), kClusterN);
    g.group = swizzle < 1 ? 1 : (swizzle > g.clusters_m ? g.clusters_m : swizzle);
    g.k_tiles = fs::tiles_along(k, kTileK);
    g.splits = splits < 1 ? 1 : splits;
    g.chunks = chunks < 0 ? 0 : chunks;
    fs::plan_tail(&g, persistent_clusters(hw_info));
    return g;
  }

  // Reduction slots: one per tail range (a split tile's slot is the range of its last piece), per CTA of a cluster.
  static size_t split_cta_tiles(fs::UnitGrid const& g) {
    return size_t(g.tail_units) * kClusterM * kClusterN;
  }

  static size_t reduction_bytes(fs::UnitGrid const& g) {
    return (split_cta_tiles(g) * kTileM * kTileN * sizeof(float) + 127) / 128 * 128;
  }

  static size_t lock_bytes(fs::UnitGrid const& g, uint32_t consumer_groups) {
    return split_cta_tiles(g) * consumer_groups * sizeof(Lock);
  }

  template <class ProblemShapeMNKL>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    typename Base::Arguments base_args;
    base_args.max_swizzle_size = 1;  // the base Params are kept for CUTLASS's kernel code; units come from `grid`
    base_args.raster_order = RasterOrderOptions::AlongN;
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base_args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    const int64_t m = cute::get<0>(problem_shape_mnkl), n = cute::get<1>(problem_shape_mnkl),
                  k = cute::get<2>(problem_shape_mnkl);
    p.m_tile_order = args.m_tile_order;
    p.ctx = args.ctx;
    p.grid = unit_grid(m, n, k, args.max_swizzle_size, args.splits, args.tail_chunks, hw_info);
    p.units = fs::unit_count(p.grid);
    p.tiles_m = fs::tiles_along(m, kTileM);
    if (kSplitK && split_cta_tiles(p.grid) > 0 && workspace != nullptr) {
      p.locks = static_cast<Lock*>(workspace);
      p.reduction = static_cast<char*>(workspace) + kLockRegionBytes;
    }
    return p;
  }

  static bool can_implement(Arguments const& args) {
    return args.max_swizzle_size >= 1 && args.splits >= 1 && args.splits <= kMaxSplits && args.tail_chunks >= 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const& args, ProblemShape problem_shape,
                                   cutlass::KernelHardwareInfo const& hw_info, uint32_t consumer_groups,
                                   const uint32_t = 1, uint32_t = 1) {
    static_assert(cute::is_same_v<ElementAccumulator, float>, "split-K partials are fp32");
    if (!kSplitK || args.splits <= 1) return 0;
    const fs::UnitGrid g = unit_grid(cute::get<0>(problem_shape), cute::get<1>(problem_shape),
                                     cute::get<2>(problem_shape), args.max_swizzle_size, args.splits, args.tail_chunks,
                                     hw_info);
    if (split_cta_tiles(g) == 0) return 0;
    return kLockRegionBytes + reduction_bytes(g);
  }

  // The locks are zeroed once by whoever allocates the workspace (flux_shmem/kernels/gemm.py) and reset by the
  // kernel itself, so there is nothing to do per launch.
  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // The persistent grid: as many clusters as fit on hw_info.sm_count SMs (CUTLASS's rule), at most one per unit.
  template <class ProblemShapeMNK, class BlockShape, class ClusterShapeT>
  CUTLASS_HOST_DEVICE static dim3 get_grid_shape(Params const& params, ProblemShapeMNK problem_shape_mnk,
                                                 BlockShape cta_shape, ClusterShapeT cluster_shape,
                                                 cutlass::KernelHardwareInfo hw_info,
                                                 typename Base::Arguments = typename Base::Arguments{},
                                                 bool = true) {
    auto problem_shape_mnkl = cute::append<4>(problem_shape_mnk, cute::Int<1>{});
    const dim3 blocks = Base::get_tiled_cta_shape_mnl(problem_shape_mnkl, cta_shape, cluster_shape);
    dim3 grid = Base::Params::get_grid_shape(blocks, cutlass::gemm::GemmCoord(kClusterM, kClusterN, 1), hw_info, 1,
                                             RasterOrderOptions::AlongN, /*truncate_by_problem_size=*/false);
    // AlongN: grid = (kClusterM, clusters * kClusterN, 1). CUTLASS sizes y as CTAs / kClusterM, which for a
    // cluster along N (1x2) and an odd SM count is not a whole number of clusters: the launch then failed with
    // CUDA_ERROR_INVALID_CLUSTER_SIZE (seen 2026-12-04, 256x128_c1x2 on 17 SMs). Whole clusters only, and exactly
    // the unit grid's stride: the tail's items are numbered by it.
    const int64_t max_y = static_cast<int64_t>(params.grid.stride) * kClusterN;
    if (static_cast<int64_t>(grid.y) > max_y) grid.y = static_cast<uint32_t>(max_y);
    grid.y = grid.y / kClusterN * kClusterN;
    if (grid.y < static_cast<uint32_t>(kClusterN)) grid.y = kClusterN;
    return grid;
  }

  CUTLASS_HOST_DEVICE OrderedTileScheduler() {}

  CUTLASS_DEVICE explicit OrderedTileScheduler(Params const& params)
      : Base(params), m_tile_order_(params.m_tile_order), grid_(params.grid), units_(params.units),
        tiles_m_(params.tiles_m) {
#if defined(__CUDA_ARCH__)
    const uint64_t linear = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x);  // AlongN
    cluster_ = static_cast<int64_t>(linear / (kClusterM * kClusterN));
    clusters_ = static_cast<int64_t>(uint64_t(gridDim.x) * gridDim.y * gridDim.z / (kClusterM * kClusterN));
    const dim3 in_cluster = cute::block_id_in_cluster();
    cta_m_ = static_cast<int32_t>(in_cluster.x);
    cta_n_ = static_cast<int32_t>(in_cluster.y);
#endif
  }

  template <class ClusterShapeT>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShapeT) { return work_at(cluster_); }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_at(cluster_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    cluster_ += clusters_ * static_cast<int64_t>(advance_count);
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo const&, uint32_t advance_count = 1) const {
    return !work_at(cluster_ + clusters_ * static_cast<int64_t>(advance_count)).is_valid();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {  // whole units only: never continue the current one
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

  template <class ProblemShape, class TileShapeT>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& w, ProblemShape, TileShapeT) {
    return w.k_count;
  }

  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const& w) {
    return static_cast<uint32_t>(w.k_start);
  }

  CUTLASS_HOST_DEVICE static bool valid_warpgroup_in_work_tile(WorkTileInfo const&) { return true; }
  CUTLASS_HOST_DEVICE static bool requires_separate_reduction(Params const&) { return false; }

  // Only the last piece of a tile (the one with K-tile 0) stores it (and signals it, for GEMM+ReduceScatter).
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const& w, Params const&) {
    return w.split == w.splits - 1;
  }

  // Split-K reduction of one consumer warpgroup's accumulators (barrier_idx = its index among num_barriers), in
  // the pieces' reduction order (w.split): piece 0 stores its partial, piece s waits for lock == s, adds its own
  // and counts itself; the last piece waits for lock == splits - 1, adds the sum to its accumulators (then runs
  // the epilogue) and resets the lock.
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& w, FrgTensorC& accumulators,
                                   uint32_t num_barriers, uint32_t barrier_idx) {
    if constexpr (kSplitK) {
      const int splits = w.splits;
      if (splits <= 1 || !w.is_valid()) return;
      using ElementAccumulator = typename FrgTensorC::value_type;
      using AccArray = cutlass::Array<ElementAccumulator, cute::size(FrgTensorC{})>;
      using Striped = cutlass::BlockStripedReduce<ReduceBarrier::ThreadCount, AccArray>;
      const uint64_t slot = static_cast<uint64_t>(w.slot);
      const int lock = static_cast<int>(slot * num_barriers + barrier_idx);
      ElementAccumulator* base = reinterpret_cast<ElementAccumulator*>(params.reduction) +
                                 slot * kTileM * kTileN +
                                 uint64_t(cute::size(accumulators)) * barrier_idx * ReduceBarrier::ThreadCount;
      AccArray* partial = reinterpret_cast<AccArray*>(base);
      AccArray* acc = reinterpret_cast<AccArray*>(accumulators.data());
      const int tid = static_cast<int>(threadIdx.x % ReduceBarrier::ThreadCount);
      if (w.split == splits - 1) {
        wait_lock(params, barrier_idx, tid, lock, splits - 1);
        Striped::load_add(*acc, partial, tid);
        if (tid == 0) params.locks[lock] = 0;  // every peer has arrived; the next launch starts from zero
      } else {
        if (w.split == 0) {
          Striped::store(partial, *acc, tid);
        } else {
          wait_lock(params, barrier_idx, tid, lock, w.split);
          Striped::reduce(partial, *acc, tid);
        }
        ReduceBarrier::arrive_inc(barrier_idx, params.locks, tid, lock, 1);
      }
    } else {
      (void)params, (void)w, (void)accumulators, (void)num_barriers, (void)barrier_idx;
    }
  }

  // CUTLASS's wait_eq with the runtime timeout: thread 0 of the warpgroup waits until the lock reaches val (locks
  // only count up between launches, so >= is ==; fs::spin_wait_ge), then the warpgroup syncs on its named barrier.
  // A piece whose predecessor never arrives reports its PE and lock instead of hanging (seen 2026-12-04 without
  // it: a silent hang, stale partials read as locks). A context without a timeout (plain kernels.gemm) waits as
  // CUTLASS does. (On a timeout the op raises on its next error check.)
  CUTLASS_DEVICE static void wait_lock(Params const& params, uint32_t barrier_idx, int tid, int lock, int val) {
    if (tid == 0) {
      const int32_t* p = reinterpret_cast<const int32_t*>(params.locks) + lock;
      const fs::Ctx ctx = params.ctx;  // a local copy for the out-of-line report
      fs::spin_wait_ge(ctx, [p] { return fs::ld_acquire_gpu_s32(p); }, int32_t(val), p, fs::kSiteSplitK, lock);
    }
    cutlass::arch::NamedBarrier::sync(ReduceBarrier::ThreadCount,
                                      static_cast<cutlass::arch::ReservedNamedBarriers>(kReduceBarrier0 + barrier_idx));
  }

 private:
  CUTLASS_DEVICE WorkTileInfo work_at(int64_t cluster) const {
    if (cluster >= units_) return WorkTileInfo::invalid_work_tile();
    const fs::Unit u = fs::unit_at(grid_, cluster);
    if (!u.valid) return WorkTileInfo::invalid_work_tile();
    WorkTileInfo w;
    w.M_idx = u.cm * kClusterM + cta_m_;
    w.N_idx = u.cn * kClusterN + cta_n_;
    w.L_idx = 0;
    w.is_valid_tile = true;
    w.split = u.split;
    w.splits = u.splits;
    w.k_start = u.k_start;
    w.k_count = u.k_count;
    w.slot = u.slot < 0 ? -1 : (u.slot * kClusterM + cta_m_) * kClusterN + cta_n_;
    if (m_tile_order_ != nullptr && w.M_idx < tiles_m_) w.M_idx = __ldg(m_tile_order_ + w.M_idx);
    return w;
  }

  const int32_t* m_tile_order_ = nullptr;
  fs::UnitGrid grid_{};
  int64_t units_ = 0;
  int32_t tiles_m_ = 0;
  int32_t cta_m_ = 0;
  int32_t cta_n_ = 0;
  int64_t cluster_ = 0;
  int64_t clusters_ = 1;
};

}  // namespace gemm
}  // namespace fs

// CUTLASS's extension point: GemmUniversal<..., fs::gemm::OrderedPersistentScheduler<S>> picks OrderedTileScheduler.
namespace cutlass::gemm::kernel::detail {
template <bool kSplitK, class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<fs::gemm::OrderedPersistentScheduler<kSplitK>, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = fs::gemm::OrderedTileScheduler<TileShape, ClusterShape, kSplitK>;
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
// ReduceScatter epilogue: mark each tile ready once its stores have landed
// ------------------------------------------------------------------------------------------------------------------

// The reduce kernel (csrc/collectives.cu) waits on the words of the tiles under each unit it sums, so a unit a
// few N-tiles wide can be reduced before its whole M-tile row is done. Words are set to the call's epoch (not
// counted up): they need no reset and no care for tiles a call does not cover, and a tile marked twice is harmless.
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

  struct Arguments : Base::Arguments {
    uint64_t* tile_ready = nullptr;
    const uint64_t* epoch = nullptr;
  };

  struct Params : Base::Params {
    uint64_t* tile_ready = nullptr;
    const uint64_t* epoch = nullptr;
    int32_t tiles_m = 0;
    int32_t tiles_n = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.tile_ready = args.tile_ready;
    p.epoch = args.epoch;
    p.tiles_m = fs::tiles_along(static_cast<long long>(cute::get<0>(problem_shape)), kTileM);
    p.tiles_n = fs::tiles_along(static_cast<long long>(cute::get<1>(problem_shape)), kTileN);
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    if (!Base::can_implement(problem_shape, args)) return false;
    return args.tile_ready == nullptr || args.epoch != nullptr;
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
    auto next = Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                            problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                            shared_tensors, subtile_idx);

    if (p.tile_ready != nullptr && thread_idx < cutlass::NumThreadsPerWarp) {
      // The base epilogue issues every TMA store of the tile from the consumer threads 0..31 (one warp); each of
      // them waits for its own bulk groups to be complete (writes included), then lane 0 publishes the tile with
      // one system fence after the warp barrier (so it orders every lane's writes, which the barrier made happen
      // before it) and a relaxed store: NVSHMEM's own fence-then-signal. (A fence in every lane and then a release
      // was two system fences per tile; that made the GEMM 5% slower, check fused_gemm_costs.)
      bulk_wait_all_complete();
      fence_proxy_async_global();
      __syncwarp();
      if (thread_idx == 0) {
        const int m_tile = static_cast<int>(cute::get<0>(tile_coord_mnkl));
        const int n_tile = static_cast<int>(cute::get<1>(tile_coord_mnkl));
        if (m_tile >= 0 && m_tile < p.tiles_m && n_tile >= 0 && n_tile < p.tiles_n) {
          if (!epoch_loaded_) {
            epoch_ = ld_volatile_u64(p.epoch);  // constant while the kernel runs (bumped after the call)
            epoch_loaded_ = true;
          }
          __threadfence_system();
          fs::st_relaxed_sys(p.tile_ready + static_cast<int64_t>(m_tile) * p.tiles_n + n_tile, epoch_);
        }
      }
    }
    return next;
  }

 private:
  Params const* ext_;
  uint64_t epoch_ = 0;
  bool epoch_loaded_ = false;
};

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

// Scale kinds of the fp8 epilogue (FsAgGemmArgs::scale_kind): which scale is a vector; the other is one float.
enum : int32_t { kScaleRowwiseA = FS_SCALE_ROWWISE_A, kScaleRowwiseB = FS_SCALE_ROWWISE_B };

// The fp8 epilogue, a CUTLASS epilogue visitor tree: D = scale_b[n] * (scale_a[m] * acc) + bias[n], in fp32, then
// rounded to ElementD. Each scale is a device pointer (CUDA graphs replay with new scale values) read as a vector
// or, with its broadcast stride set to false at run time, as a scalar (CUTLASS's dynamic broadcast): one kernel
// serves per-tensor, rowwise and mixed scales. Bias null reads as zeros. Alignment 1 on the scales: any fp32
// pointer will do (they are read once per tile).
namespace evt {
using namespace cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using StrideScaleA = cute::Stride<bool, cute::_0, int64_t>;  // [M] (true) or scalar (false)
using StrideScaleB = cute::Stride<cute::_0, bool, int64_t>;  // [N] (true) or scalar (false)
template <class Tile>
using ScaleA = Sm90ColBroadcast<0, Tile, float, float, StrideScaleA, 1>;
template <class Tile>
using ScaleB = Sm90RowBroadcast<0, Tile, float, float, StrideScaleB, 1>;
template <class Tile, class ElementBias>
using Bias = Sm90RowBroadcast<0, Tile, ElementBias, float>;
template <class Tile, class ElementD, class ElementBias>
using ScaledAccBias =
    Sm90EVT<Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,  // scale_b * (.) + bias
            ScaleB<Tile>,
            Sm90EVT<Sm90Compute<cutlass::multiplies, float, float, kRound>, ScaleA<Tile>, Sm90AccFetch>,
            Bias<Tile, ElementBias>>;
}  // namespace evt

// Operand types of a build. Element (cutlass::bfloat16_t, cutlass::half_t): A, B, D and bias alike, D = acc +
// bias[n] (CUTLASS's LinCombPerColBias). ScaledFp8<AB, D>: e4m3 A and B, D and bias of type D, the scaled
// epilogue above.
template <class ElementAB, class ElementD>
struct ScaledFp8 {};

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
