// Epilogue extensions: the reduce-scatter epilogue that marks each tile ready once its stores have landed, and
// the fp8 builds' scaled epilogue (a CUTLASS epilogue visitor tree).
// Part of gemm_ext.cuh (include that, not this file): it relies on what gemm_ext.cuh includes first.
#pragma once

namespace fs {
namespace gemm {

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

}  // namespace gemm
}  // namespace fs
