// The all-gather mainloop: CUTLASS's sm90 TMA warp-specialized mainloop whose producer first waits for the
// all-gather chunks covering the tile's rows.
// Part of gemm_ext.cuh (include that, not this file): it relies on what gemm_ext.cuh includes first.
#pragma once

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

}  // namespace gemm
}  // namespace fs
