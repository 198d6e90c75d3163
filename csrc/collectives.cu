// Communication engines over symmetric memory: barrier, all-gather, reduce-scatter, and the per-call epoch.
//
// Synchronisation without host round trips or resets: each op owns a device-side epoch counter (1 on the first
// call, bumped by fs_epoch_bump at the end of every call). Signals are SET to (or counted up to) the epoch and
// waited on with >=, so they never need resetting and a captured CUDA graph replays correctly. Before a PE writes
// into a peer's buffers it waits for that peer's arrival signal of this epoch: the peer has finished the previous
// call, so nothing it still reads is overwritten.
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "flux_shmem/comm_schedule.cuh"
#include "flux_shmem/put.cuh"
#include "flux_shmem/signal.cuh"

namespace fs {

// Block 0: tell every PE that this PE has entered epoch e (its previous call is complete).
__device__ __forceinline__ void arrive(const Ctx& ctx, uint64_t* bar, uint64_t e, const Topo& t) {
  if (blockIdx.x != 0) return;
  for (int p = threadIdx.x; p < t.world; p += blockDim.x) {
    const bool same_node = p / t.node_size == t.node();
    signal_set(bar + t.me, e, p, same_node);
  }
}

}  // namespace fs

using namespace fs;

// ---------------------------------------------------------------------------------------------------------------
struct EpochArgs {
  uint64_t* epoch;
};

extern "C" __global__ void fs_epoch_bump(const __grid_constant__ EpochArgs a) {
#ifdef FS_DEVICE_PASS
  if (threadIdx.x == 0 && blockIdx.x == 0) *a.epoch += 1;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Barrier over all PEs (one block): arrive, then wait for every PE's arrival of this epoch.
struct BarrierArgs {
  Ctx ctx;
  uint64_t* bar;          // symmetric [world]
  const uint64_t* epoch;  // local
  int node_size;
  int pad_;
};

extern "C" __global__ void fs_barrier(const __grid_constant__ BarrierArgs a) {
#ifdef FS_DEVICE_PASS
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  arrive(a.ctx, a.bar, e, t);
  for (int p = threadIdx.x; p < t.world; p += blockDim.x)
    if (!wait_ge(a.ctx, a.bar + p, e, kSiteBarrier, p)) break;
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_quiet();
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Test hook: one thread waits for *sig >= expected (timeouts and error records are tested through this).
struct WaitArgs {
  Ctx ctx;
  const uint64_t* sig;
  uint64_t expected;
};

extern "C" __global__ void fs_wait_signal(const __grid_constant__ WaitArgs a) {
#ifdef FS_DEVICE_PASS
  if (threadIdx.x == 0 && blockIdx.x == 0) wait_ge(a.ctx, a.sig, a.expected, kSiteTest, 0);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// All-gather of equal shards into a symmetric gather buffer, one signal per (source PE, chunk).
struct AgArgs {
  Ctx ctx;
  const uint8_t* src;      // this PE's shard (any device memory; may alias its own slot of `gather`)
  uint8_t* gather;         // symmetric [world * shard_bytes]
  uint64_t* flags;         // symmetric [world * chunks]; flag of (s, c) >= epoch: chunk c of shard s is here
  uint64_t* bar;           // symmetric [world] arrival slots
  const uint64_t* epoch;   // local
  uint64_t shard_bytes;
  uint64_t chunk_bytes;
  int chunks;
  int node_size;
  int wait_all;            // standalone op: return only once every chunk of every shard has arrived here
  int pad_;
};

extern "C" __global__ void __launch_bounds__(512) fs_all_gather(const __grid_constant__ AgArgs a) {
#ifdef FS_DEVICE_PASS
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  arrive(a.ctx, a.bar, e, t);
  bool used_put = false;
  const int units = ag_num_units(t, a.chunks);
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const AgUnit w = ag_unit(t, a.chunks, u);
    const uint64_t off = uint64_t(w.src) * a.shard_bytes + chunk_begin(a.chunk_bytes, w.chunk);
    const uint64_t bytes = chunk_size(a.shard_bytes, a.chunk_bytes, w.chunk);
    uint64_t* flag = a.flags + w.src * a.chunks + w.chunk;
    if (w.kind == kLocal) {
      const uint8_t* from = a.src + chunk_begin(a.chunk_bytes, w.chunk);
      if (from != a.gather + off) block_copy(a.gather + off, from, bytes);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        st_release_sys(flag, e);
      }
      __syncthreads();
      continue;
    }
    // The source chunk must be in place (my own copy, or the forward's incoming data) and the destination must
    // have arrived in this epoch before anything is written into it.
    if (!block_wait_ge(a.ctx, flag, e, kSiteChunk, w.src * a.chunks + w.chunk)) break;
    if (!block_wait_ge(a.ctx, a.bar + w.dest, e, kSiteBarrier, w.dest)) break;
    used_put |= put_signal_block(a.gather + off, a.gather + off, bytes, flag, e, w.dest, w.kind != kPut);
  }
  if (a.wait_all) {  // (the fused op's GEMM waits per tile instead)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < t.world * a.chunks; i += gridDim.x * blockDim.x)
      if (!wait_ge(a.ctx, a.flags + i, e, kSiteChunk, i)) break;
  }
  __syncthreads();
  if (used_put && threadIdx.x == 0) nvshmem_quiet();  // source chunks may be overwritten by the next call
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Reduce-scatter of [M, N] partials (fp32 accumulation), two-level across nodes.
struct RsArgs {
  Ctx ctx;
  const uint8_t* src;          // standalone op: this PE's input [M, N], copied into `partial` first; null: fused
  uint8_t* partial;            // symmetric [M, N]: this PE's addend (every PE's is read by its node peers)
  uint8_t* stage;              // symmetric [nodes, Ms, N]: node partials on their way to other nodes
  uint8_t* recv;               // symmetric [nodes, Ms, N]: node partials of my segment, one slot per node
  uint64_t* recv_sig;          // symmetric [nodes * max_units]
  uint8_t* out;                // local [Ms, N]
  const uint8_t* bias;         // [N] or null
  uint64_t* rows_ready;        // symmetric [tiles_m] counters: +1 per finished (M-tile, N-tile) of `partial`
  uint64_t* bar;               // symmetric [world]
  const uint64_t* epoch;       // local
  int64_t m, n;
  int64_t rows_per_shard;      // Ms = M / world
  int tile_m, tiles_n;         // GEMM tile height and N-tile count (counter target = epoch * tiles_n)
  int unit_rows;               // divides tile_m
  int node_size;
  int max_tiles_m;             // length of rows_ready (the op's largest M)
  int pad_;
};

namespace fs {

template <typename T> struct Vec;  // 16 bytes of T <-> floats
template <> struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void load(const void* p, float* f) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __bfloat1622float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
  __device__ static void store(void* p, const float* f) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = v;
  }
};
template <> struct Vec<__half> {
  static constexpr int kN = 8;
  __device__ static void load(const void* p, float* f) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __half22float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
  __device__ static void store(void* p, const float* f) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = v;
  }
};
template <> struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void load(const void* p, float* f) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
  }
  __device__ static void store(void* p, const float* f) { *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]); }
};

// out[i] = sum_k srcs[k][i] (+ bias[col]) over `elems` elements of rows of width n; elems % kN == 0 and
// every pointer 16-byte aligned (checked on the host). Sources are summed in the order given.
template <typename T, int kMaxSrc>
__device__ void block_sum(T* out, const T* const* srcs, int nsrc, int64_t elems, int64_t n, const T* bias) {
  using V = Vec<T>;
  for (int64_t i = int64_t(threadIdx.x) * V::kN; i < elems; i += int64_t(blockDim.x) * V::kN) {
    float acc[V::kN], x[V::kN];
    V::load(srcs[0] + i, acc);
    for (int k = 1; k < nsrc; ++k) {
      V::load(srcs[k] + i, x);
#pragma unroll
      for (int j = 0; j < V::kN; ++j) acc[j] += x[j];
    }
    if (bias != nullptr) {
      V::load(bias + (i % n), x);
#pragma unroll
      for (int j = 0; j < V::kN; ++j) acc[j] += x[j];
    }
    V::store(out + i, acc);
  }
}

constexpr int kMaxNodeSize = 8;
constexpr int kMaxNodes = 64;

template <typename T>
__device__ void reduce_scatter(const RsArgs& a) {
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  arrive(a.ctx, a.bar, e, t);
  const int Nn = t.nodes(), L = t.node_size;
  const int64_t Ms = a.rows_per_shard, N = a.n;
  const int max_units = rs_max_units_per_segment(Ms, a.unit_rows);
  const T* partial = reinterpret_cast<const T*>(a.partial);
  T* stage = reinterpret_cast<T*>(a.stage);
  T* recv = reinterpret_cast<T*>(a.recv);
  T* out = reinterpret_cast<T*>(a.out);
  const T* bias = reinterpret_cast<const T*>(a.bias);
  bool used_put = false;
  if (blockIdx.x == 0) {
    // Counters of M-tiles beyond this call's M get their tiles_n increments too, so every counter stays at
    // epoch * tiles_n and a later call with a larger M waits for the right value.
    for (int i = int((a.m + a.tile_m - 1) / a.tile_m) + threadIdx.x; i < a.max_tiles_m; i += blockDim.x)
      atomicAdd(reinterpret_cast<unsigned long long*>(a.rows_ready + i), (unsigned long long)a.tiles_n);
  }
  if (a.src != nullptr) {
    // Standalone: copy my input into my symmetric addend, but only once my node's PEs have arrived in this
    // epoch (they no longer read the previous call's addend). Each copied row block counts as one tile.
    const int copy_units = int((a.m + a.unit_rows - 1) / a.unit_rows);
    bool peers_arrived = false;
    for (int cu = blockIdx.x; cu < copy_units; cu += gridDim.x) {
      for (int q = 0; q < L && !peers_arrived; ++q)
        if (!block_wait_ge(a.ctx, a.bar + t.pe(t.node(), q), e, kSiteBarrier, t.pe(t.node(), q))) return;
      peers_arrived = true;
      const int64_t lo = int64_t(cu) * a.unit_rows, hi = lo + a.unit_rows < a.m ? lo + a.unit_rows : a.m;
      const size_t off = size_t(lo * N) * sizeof(T);
      if (a.src != a.partial) block_copy(a.partial + off, a.src + off, size_t((hi - lo) * N) * sizeof(T));
      __syncthreads();
      if (threadIdx.x == 0) { __threadfence_system(); red_add_release_sys(a.rows_ready + lo / a.tile_m, 1); }
      __syncthreads();
    }
  }
  const int units = rs_num_units(t, Ms, a.unit_rows);
  for (int idx = blockIdx.x; idx < units; idx += gridDim.x) {
    const RsUnit w = rs_unit(t, Ms, a.unit_rows, idx);
    int64_t lo, hi;
    rs_unit_rows(Ms, a.unit_rows, w.seg, w.u, &lo, &hi);
    const int64_t seg_row = lo - int64_t(w.seg) * Ms;  // row inside the segment
    const int64_t elems = (hi - lo) * N;
    if (w.phase == 0) {
      // Node-level sum of rows [lo, hi) over my node's PEs, in local-index order.
      const T* srcs[kMaxNodeSize];
      for (int q = 0; q < L; ++q) {
        const int pe = t.pe(t.node(), q);
        // The counter of this M-tile on that PE: complete once all its N-tiles of this epoch are written.
        const uint64_t* c = a.rows_ready + lo / a.tile_m;
        const uint64_t* ready_at = pe == t.me ? c : static_cast<const uint64_t*>(nvshmem_ptr(c, pe));
        if (!block_wait_ge(a.ctx, ready_at, e * uint64_t(a.tiles_n), kSiteRows, int(lo / a.tile_m))) return;
        srcs[q] = static_cast<const T*>(pe == t.me ? partial + lo * N : nvshmem_ptr(partial + lo * N, pe));
      }
      const int dst_node = w.seg / L;
      if (Nn == 1) {  // one node: this is the final sum
        block_sum<T, kMaxNodeSize>(out + seg_row * N, srcs, L, elems, N, bias);
        continue;
      }
      const T* send = srcs[0];
      T* slot = (dst_node == t.node() ? recv + int64_t(t.node()) * Ms * N : stage + int64_t(dst_node) * Ms * N) +
                seg_row * N;
      if (L > 1 || dst_node == t.node()) {
        block_sum<T, kMaxNodeSize>(slot, srcs, L, elems, N, nullptr);
        send = slot;
      }
      __syncthreads();
      uint64_t* sig = a.recv_sig + t.node() * max_units + w.u;
      if (dst_node == t.node()) {  // my own segment's node partial stays here
        if (threadIdx.x == 0) { __threadfence(); st_release_sys(sig, e); }
        __syncthreads();
        continue;
      }
      if (!block_wait_ge(a.ctx, a.bar + w.seg, e, kSiteBarrier, w.seg)) return;
      T* remote_slot = recv + int64_t(t.node()) * Ms * N + seg_row * N;
      used_put |= put_signal_block(remote_slot, send, elems * sizeof(T), sig, e, w.seg, false);
    } else {
      // Final sum of my segment over the node partials, in node order.
      const T* srcs[kMaxNodes];
      for (int j = 0; j < Nn; ++j) {
        if (!block_wait_ge(a.ctx, a.recv_sig + j * max_units + w.u, e, kSiteRecv, j * max_units + w.u)) return;
        srcs[j] = recv + int64_t(j) * Ms * N + seg_row * N;
      }
      block_sum<T, kMaxNodes>(out + seg_row * N, srcs, Nn, elems, N, bias);
    }
  }
  __syncthreads();
  if (used_put && threadIdx.x == 0) nvshmem_quiet();
}

}  // namespace fs

#define FS_RS_KERNEL(NAME, T)                                                          \
  extern "C" __global__ void __launch_bounds__(512) NAME(const __grid_constant__ RsArgs a) { \
    FS_RS_BODY(T)                                                                      \
  }
#ifdef FS_DEVICE_PASS
#define FS_RS_BODY(T) fs::reduce_scatter<T>(a);
#else
#define FS_RS_BODY(T)
#endif
FS_RS_KERNEL(fs_reduce_scatter_bf16, __nv_bfloat16)
FS_RS_KERNEL(fs_reduce_scatter_fp16, __half)
FS_RS_KERNEL(fs_reduce_scatter_fp32, float)
