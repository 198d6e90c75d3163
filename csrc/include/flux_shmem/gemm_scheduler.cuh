// The ordered persistent tile scheduler (M-tiles in a device array's order, swizzle groups along N, no padding
// tiles, stream-K tails) and CUTLASS's TileSchedulerSelector specialization that plugs it in.
// Part of gemm_ext.cuh (include that, not this file): it relies on what gemm_ext.cuh includes first.
#pragma once

namespace fs {
namespace gemm {

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
