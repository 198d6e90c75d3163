// Communication engines over symmetric memory: barrier, all-gather, reduce-scatter, and the per-call epoch.
//
// What each thread block does, in which order, is a plan made in Python (flux_shmem/ops/_schedule.py ag_plan,
// rs_plan) and read here as a table of int4 items with per-block offsets: the kernels hold no schedule logic, and
// the simulator (flux_shmem/ops/simulate.py) runs the same plans.
//
// Synchronisation without host round trips or resets: each op owns a device-side epoch counter (1 on the first
// call, bumped by fs_epoch_bump at the end of every call). Signals are SET to the epoch and
// waited on with >=, so they never need resetting and a captured CUDA graph replays correctly. Before a PE writes
// into a peer's buffers it waits for that peer's arrival signal of this epoch: the peer has finished the previous
// call, so nothing it still reads is overwritten.
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "flux_shmem/comm_schedule.cuh"
#include "flux_shmem/pace.cuh"
#include "flux_shmem/put.cuh"
#include "flux_shmem/signal.cuh"

namespace fs {

// Tell every PE that this PE has entered epoch e (its previous call is complete). Every block stores it into the
// mapped slots of its node peers (idempotent stores: peers wait for the arrival before sending, and must not depend
// on one particular block of this kernel being resident; seen 2026-12-03: 4 PEs under MPS, 3 of them waiting for
// arrivals of an epoch). PEs reached only by NVSHMEM signal ops (other nodes, forced puts) get it once per pair,
// from block 0: one proxy operation per peer and call, not one per block (hundreds to thousands at 2 x 8 and 8 x 8).
// Block 0 of a comm kernel always runs: its other blocks wait on nothing of block 0's before they end.
__device__ __forceinline__ void arrive(const Ctx& ctx, uint64_t* bar, uint64_t e, const Topo& t) {
  for (int p = threadIdx.x; p < t.world; p += blockDim.x) {
    uint64_t* mapped = p / t.node_size == t.node() ? static_cast<uint64_t*>(nvshmem_ptr(bar + t.me, p)) : nullptr;
    if (mapped != nullptr) {
      __threadfence_system();
      st_release_sys(mapped, e);
    } else if (blockIdx.x == 0) {
      nvshmemx_signal_op(bar + t.me, e, NVSHMEM_SIGNAL_SET, p);
    }
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
// One thread waits for *sig >= expected with the runtime timeout: the all-gather start gate, signals.wait, and the
// timeout/error-record tests.
struct WaitArgs {
  Ctx ctx;
  const uint64_t* sig;
  uint64_t expected;
  int site;   // what the timeout report calls the signal (kSite*, or 6: the all-gather start gate, abi.SITES)
  int index;
};

extern "C" __global__ void fs_wait_signal(const __grid_constant__ WaitArgs a) {
#ifdef FS_DEVICE_PASS
  if (threadIdx.x == 0 && blockIdx.x == 0) wait_ge(a.ctx, a.sig, a.expected, a.site, a.index);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// One block waits until flags[first + i * stride] >= *target for every i < count: a stream held until chunk c of
// every PE's all-gather shard is here (first = c, stride = chunks per shard), for consumers that are not our GEMMs
// (the MoE ops' pipelined grouped GEMMs). The target is a device word (the all-gather's epoch), so a replayed graph
// waits for its own call; one thread per flag, so the polls overlap, each with the runtime's timeout.
struct WaitFlagsArgs {
  Ctx ctx;
  const uint64_t* flags;
  const uint64_t* target;
  int first;
  int stride;
  int count;
  int site;  // what a timeout report calls the flags (kSite*), with index first + i * stride
};

extern "C" __global__ void fs_wait_flags(const __grid_constant__ WaitFlagsArgs a) {
#ifdef FS_DEVICE_PASS
  const uint64_t e = *a.target;
  for (int i = threadIdx.x; i < a.count; i += blockDim.x) {
    const int idx = a.first + i * a.stride;
    if (!wait_ge(a.ctx, a.flags + idx, e, a.site, idx)) break;
  }
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Test hook / ReduceScatter.input_buffer: wait until every PE of my node has finished reading my reduce-scatter
// input of the previous call (done[q] >= epoch - 1).
struct WaitDoneArgs {
  Ctx ctx;
  const uint64_t* done;   // symmetric [world]
  const uint64_t* epoch;  // local
  int node_size;
  int pad_;
};

extern "C" __global__ void fs_wait_done(const __grid_constant__ WaitDoneArgs a) {
#ifdef FS_DEVICE_PASS
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  if (e <= 1) return;
  for (int i = threadIdx.x; i < t.node_size; i += blockDim.x) {
    const int q = t.pe(t.node(), i);
    if (!wait_ge(a.ctx, a.done + q, e - 1, kSiteDone, q)) break;
  }
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// GEMMReduceScatter's done protocol (FLUX_SHMEM_RS_DONE=1): after every reduce launch of a call has ended on this
// stream, tell my node's PEs that I no longer read their addends of this epoch (done[me] = epoch on each), which
// their next call's fs_wait_done waits for instead of a barrier of every PE. One block, one thread per node PE.
extern "C" __global__ void fs_signal_done(const __grid_constant__ WaitDoneArgs a) {
#ifdef FS_DEVICE_PASS
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  uint64_t* mine = const_cast<uint64_t*>(a.done) + t.me;  // (the struct is fs_wait_done's, whose view is read-only)
  for (int i = threadIdx.x; i < t.node_size; i += blockDim.x) signal_set(mine, e, t.pe(t.node(), i), true);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// All-gather of equal shards into a symmetric gather buffer, one signal per (source PE, chunk).
enum AgKind : int { kLocal = 0, kPut = 1, kDirect = 2, kForward = 3, kAccept = 4 };  // flux_shmem/ops/_schedule.py

struct AgArgs {
  Ctx ctx;
  const uint8_t* src;      // this PE's shard (any device memory; may alias its own slot of `gather`)
  uint8_t* gather;         // symmetric [world * shard_bytes]
  uint64_t* flags;         // symmetric [world * chunks]; flag of (s, c) >= epoch: chunk c of shard s is here
  uint64_t* recv;          // symmetric [world * chunks]: the same, raised by a put from another node (kAccept)
  uint64_t* bar;           // symmetric [world] arrival slots
  const uint64_t* epoch;   // local
  const int4* units;       // plan: (kind, src PE, dest PE, chunk)
  const int32_t* block_begin;  // [gridDim.x + 1]: block b does units [block_begin[b], block_begin[b + 1])
  // Local [2] or null: [0] counts this launch's blocks that have started; the last one resets it and sets [1] to
  // 1, which the consumer's stream waits for (cuStreamWaitValue64) before launching the GEMM that spins on flags.
  unsigned long long* started;
  uint64_t shard_bytes;
  uint64_t chunk_bytes;
  int chunks;
  int node_size;
  int wait_all;            // standalone op: return only once every chunk of every shard has arrived here
  int pad_;
  Pace pace;
};

extern "C" __global__ void __launch_bounds__(512) fs_all_gather(const __grid_constant__ AgArgs a) {
#ifdef FS_DEVICE_PASS
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  if (a.started != nullptr && threadIdx.x == 0 &&
      atomicAdd(a.started, 1ull) == static_cast<unsigned long long>(gridDim.x) - 1) {
    atomicExch(a.started, 0ull);  // every block runs: the next launch counts from zero
    __threadfence_system();
    atomicExch(a.started + 1, 1ull);
  }
  arrive(a.ctx, a.bar, e, t);
  bool used_put = false;
  for (int i = a.block_begin[blockIdx.x]; i < a.block_begin[blockIdx.x + 1]; ++i) {
    const int4 w = a.units[i];
    const int kind = w.x, src = w.y, dest = w.z, chunk = w.w;
    const uint64_t in_shard = chunk_begin(a.chunk_bytes, chunk);
    const uint64_t off = uint64_t(src) * a.shard_bytes + in_shard;
    const uint64_t bytes = chunk_size(a.shard_bytes, a.chunk_bytes, chunk);
    uint64_t* flag = a.flags + src * a.chunks + chunk;
    if (kind == kLocal) {
      const uint8_t* from = a.src + in_shard;
      if (from != a.gather + off) block_copy(a.gather + off, from, bytes);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        st_release_sys(flag, e);
      }
      __syncthreads();
      continue;
    }
    if (kind == kAccept) {  // a chunk put here from another node: NVSHMEM's wait, then its flag for my readers
      if (!block_wait_put_ge(a.ctx, a.recv + src * a.chunks + chunk, e, kSiteChunk, src * a.chunks + chunk)) break;
      if (threadIdx.x == 0) st_release_sys(flag, e);
      __syncthreads();
      continue;
    }
    // A put or forward sends from my gather buffer: that chunk must be in place (my local copy, or the network's
    // incoming data, accepted). A direct store sends my own shard straight from its source. The destination must
    // have arrived in this epoch (finished its previous call) before anything is written into it.
    if (kind != kDirect && !block_wait_ge(a.ctx, flag, e, kSiteChunk, src * a.chunks + chunk)) break;
    if (!block_wait_ge(a.ctx, a.bar + dest, e, kSiteBarrier, dest)) break;
    const int cls = dest / t.node_size != t.node() ? 1 : 0;
    const unsigned long long paced_end = block_pace_reserve(a.pace, cls, bytes);
    const uint8_t* from = kind == kDirect ? a.src + in_shard : a.gather + off;
    uint64_t* sig = kind == kPut ? a.recv + src * a.chunks + chunk : flag;  // (a put is accepted at its target)
    used_put |= put_signal_block(a.gather + off, from, bytes, sig, e, dest, kind != kPut, paced_end);
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
// Reduce-scatter of [M, N] partials (fp32 accumulation), two-level across nodes, by plan items
// (flux_shmem/ops/_schedule.py rs_items); unit u of a segment covers rows x a column group (comm_schedule.cuh
// rs_unit):
//   COPY      standalone op: copy my input rows into my symmetric addend, mark them as finished "tiles"
//   NODE_SUM  a segment with my local index: once every PE of my node has finished the GEMM tiles under the unit,
//             sum their partials in local-index order; one node: + bias -> out; else the node partial goes to the
//             segment's owner (put with signal; my own segment's stays in my receive slot)
//   FINAL     my segment, several nodes: out = node partials summed in node order + bias
enum RsOp : int { kCopy = 0, kNodeSum = 1, kFinal = 2 };

struct RsArgs {
  Ctx ctx;
  const uint8_t* src;          // standalone op: this PE's input [M, N] (COPY items); null: fused
  uint8_t* partial;            // symmetric [M, N]: this PE's addend (every PE's is read by its node peers)
  uint8_t* stage;              // symmetric [nodes, Ms, N]: node partials on their way to other nodes (packed units)
  uint8_t* recv;               // symmetric [nodes, Ms, N]: node partials of my segment, one slot per node (packed)
  uint64_t* recv_sig;          // symmetric [nodes * max_units]
  uint8_t* out;                // local [Ms, N]
  const uint8_t* bias;         // [N] or null
  uint64_t* tile_ready;        // symmetric [max_tiles_m * tiles_n]: word of tile (m, n) = epoch once `partial` has it
  uint64_t* seen;              // local [world * max_tiles_m * tiles_n]: epoch in which (PE, tile) was seen ready
  uint64_t* bar;               // symmetric [world]
  uint64_t* done;              // symmetric [world]: done[q] = epoch once PE q has finished reading my partial
  unsigned long long* exits;   // local [2]: blocks of this kernel that finished, per epoch parity
  const uint64_t* epoch;       // local
  const int4* items;           // plan: (op, segment, unit, 0)
  const int32_t* block_begin;  // [gridDim.x + 1]
  int64_t m, n;
  int64_t rows_per_shard;      // Ms = M / world
  int tile_m, tile_n;          // the GEMM's tile (standalone op: unit_rows x N)
  int tiles_n;                 // N-tiles: ceil(n / tile_n)
  int group_tiles;             // N-tiles per unit (tiles_n: whole rows)
  int unit_rows;               // divides tile_m
  int node_size;
  int max_tiles_m;             // M-tiles of tile_ready (the op's largest M)
  int max_units;               // receive-signal slots per node
  int flags;                   // kRsSignalDone | kRsEvictFirst | kRsPollSleep
  int pad_;
  Pace pace;
};

// RsArgs.flags. A fused call runs two reduce kernels: one beside the GEMM, and one with many blocks after it for
// the pieces of the GEMM's last wave (the "tail"); neither needs the done signal (every fused call starts with a
// barrier, after which nobody reads the previous call's partials).
constexpr int kRsSignalDone = 2;      // the last block tells my node's PEs I no longer read their addends
constexpr int kRsEvictFirst = 4;      // loads and stores of the sums with an L2 evict-first policy (block_sum)
constexpr int kRsPollSleep = 8;       // waits for GEMM tiles sleep between polls (wait_ge_polite)

namespace fs {

template <typename T> struct Vec;  // 16 bytes of T (raw) <-> floats
template <> struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void set(const uint4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __bfloat1622float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
  __device__ static void add(const uint4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __bfloat1622float2(h[i]); f[2 * i] += x.x; f[2 * i + 1] += x.y; }
  }
  __device__ static uint4 pack(const float* f) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};
template <> struct Vec<__half> {
  static constexpr int kN = 8;
  __device__ static void set(const uint4& v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __half22float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
  __device__ static void add(const uint4& v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __half22float2(h[i]); f[2 * i] += x.x; f[2 * i + 1] += x.y; }
  }
  __device__ static uint4 pack(const float* f) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};
template <> struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void set(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ static void add(const uint4& v, float* f) {
    f[0] += __uint_as_float(v.x); f[1] += __uint_as_float(v.y); f[2] += __uint_as_float(v.z); f[3] += __uint_as_float(v.w);
  }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

// 16-byte loads and stores; kEvict: with an L2 evict-first policy (`pol`, createpolicy), so that the partials a
// reduce streams through once do not push the GEMM's operand tiles out of L2 (RsArgs.flags kRsEvictFirst).
template <bool kEvict>
__device__ __forceinline__ uint4 ld16(const void* p, uint64_t pol) {
  if constexpr (!kEvict) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    uint4 v;
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol) : "memory");
    return v;
  }
}
template <bool kEvict>
__device__ __forceinline__ void st16(void* p, const uint4& v, uint64_t pol) {
  if constexpr (!kEvict) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
  }
}
template <bool kEvict>
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol = 0;
  if constexpr (kEvict) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// Whole block, over a rows x w block of elements: dst = sum over k < nsrc of src(k) (+ bias[col]) in fp32, sources
// in order (deterministic). Row r of the block starts at r * src_stride in every source and at r * dst_stride in
// dst (a stride of w: packed). w is a multiple of the vector width, so no vector straddles two rows.
// A block is latency-bound: each pass waits for one round of loads per source. So every pass is the unrolled one,
// kU vectors per thread, the last one cut short (a narrow unit of 8 x 1792 bf16 is one pass, not 3.5 passes of one
// vector each: seen 2026-12-05 on an H100, units 7 N-tiles wide were summed at 11 GB/s per block through such a
// one-vector remainder loop against >= 22 GB/s for whole rows, and GEMM+RS fused ran 0.60x of decomposed). Loads of
// two sources at once spilled (40 B with bf16 under the 128 registers of 512 threads).
template <bool kEvict, typename T, typename Src>
__device__ __forceinline__ void block_sum(T* dst, int64_t dst_stride, Src src, int64_t src_stride, int nsrc,
                                          int64_t rows, int64_t w, const T* bias) {
  using V = Vec<T>;
  const uint64_t pol = evict_first_policy<kEvict>();
  constexpr int kN = V::kN, kU = 4;
  // (32-bit indices: a unit has far fewer than 2^32 elements, ReduceEngine checks; 64-bit offsets for every
  // vector made the kernel spill)
  const uint32_t elems = uint32_t(rows * w), step = blockDim.x * kN, w32 = uint32_t(w);
  for (uint32_t i = threadIdx.x * kN; i < elems; i += kU * step) {
    const int nv = elems - i > (kU - 1) * step ? kU : int((elems - i + step - 1) / step);  // vectors of this pass
    float s[kU][kN];
    uint4 x[kU];
    uint32_t row[kU], col[kU];
#define ok(u) ((u) < nv)
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t f = ok(u) ? i + u * step : i;  // past the end: re-read my first vector, store nothing
      row[u] = f / w32;
      col[u] = f - row[u] * w32;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      V::set(ld16<kEvict>(src(0) + (int64_t(row[u]) * src_stride + col[u]), pol), s[u]);
    for (int k = 1; k < nsrc; ++k) {
      const T* p = src(k);
#pragma unroll
      for (int u = 0; u < kU; ++u)
        x[u] = ld16<kEvict>(p + (int64_t(row[u]) * src_stride + col[u]), pol);
#pragma unroll
      for (int u = 0; u < kU; ++u) V::add(x[u], s[u]);
    }
    if (bias != nullptr) {
#pragma unroll
      for (int u = 0; u < kU; ++u)
        V::add(ld16<false>(bias + col[u], pol), s[u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (ok(u)) st16<kEvict>(dst + (int64_t(row[u]) * dst_stride + col[u]), V::pack(s[u]), pol);
  }
#undef ok
}

// Block-wide: wait until every PE of my node has finished the GEMM tiles (tile, [nt0, nt1)) of this epoch. One
// thread per (PE, tile) polls, so remote polls overlap; a tile once seen ready is remembered in `seen` (local
// memory), so other units over that tile do not poll over the network again.
__device__ bool wait_node_tiles(const RsArgs& a, const Topo& t, int tile, int nt0, int nt1, uint64_t e) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  const int span = nt1 - nt0;
  const int64_t tiles = int64_t(a.max_tiles_m) * a.tiles_n;
  for (int i = threadIdx.x; i < t.node_size * span; i += blockDim.x) {
    const int q = t.pe(t.node(), i / span);
    const int64_t idx = int64_t(tile) * a.tiles_n + nt0 + i % span;
    uint64_t* s = a.seen + q * tiles + idx;
    if (ld_acquire_gpu(s) >= e) continue;
    const uint64_t* c = a.tile_ready + idx;
    const uint64_t* at = q == t.me ? c : static_cast<const uint64_t*>(nvshmem_ptr(c, q));
    if (!wait_ge_polite(a.ctx, at, e, kSiteRows, int(q * tiles + idx), (a.flags & kRsPollSleep) != 0)) {
      ok = 0;
      continue;
    }
    st_release_gpu(s, e);
  }
  __syncthreads();
  return ok != 0;
}

template <typename T, bool kEvict>
__device__ void reduce_scatter(const RsArgs& a) {
  const Topo t{a.ctx.my_pe, a.ctx.n_pes, a.node_size};
  const uint64_t e = *a.epoch;
  arrive(a.ctx, a.bar, e, t);
  const int Nn = t.nodes(), L = t.node_size, node = t.node();
  const int64_t Ms = a.rows_per_shard, N = a.n;
  T* stage = reinterpret_cast<T*>(a.stage);
  T* recv = reinterpret_cast<T*>(a.recv);
  T* out = reinterpret_cast<T*>(a.out);
  const T* bias = reinterpret_cast<const T*>(a.bias);
  // My node's addends (dynamic shared memory sized for node_size at launch: no cap on the node size).
  extern __shared__ uint64_t fs_rs_smem[];
  const T** node_partial = reinterpret_cast<const T**>(fs_rs_smem);
  for (int q = threadIdx.x; q < L; q += blockDim.x) {
    const int pe = t.pe(node, q);
    node_partial[q] = reinterpret_cast<const T*>(pe == t.me ? a.partial : nvshmem_ptr(a.partial, pe));
  }
  __syncthreads();
  bool used_put = false;
  bool peers_arrived = false;
  for (int it = a.block_begin[blockIdx.x]; it < a.block_begin[blockIdx.x + 1]; ++it) {
    const int4 w = a.items[it];
    const int op = w.x, seg = w.y, u = w.z;
    if (op == kCopy) {
      // Copy my input into my symmetric addend once my node's PEs have arrived in this epoch (they no longer read
      // the previous call's addend). Each copied row block is one tile (tile_m = unit_rows, one N-tile).
      for (int q = 0; q < L && !peers_arrived; ++q)
        if (!block_wait_ge(a.ctx, a.bar + t.pe(node, q), e, kSiteBarrier, t.pe(node, q))) return;
      peers_arrived = true;
      const int64_t lo = int64_t(u) * a.unit_rows, hi = lo + a.unit_rows < a.m ? lo + a.unit_rows : a.m;
      const size_t off = size_t(lo * N) * sizeof(T);
      if (a.src != a.partial) block_copy(a.partial + off, a.src + off, size_t((hi - lo) * N) * sizeof(T));
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();  // (after the barrier: orders every thread's copy before the mark)
        st_relaxed_sys(a.tile_ready + (lo / a.tile_m) * a.tiles_n, e);
      }
      __syncthreads();
      continue;
    }
    const RsRect r = rs_unit(Ms, a.unit_rows, N, a.tile_n, a.group_tiles, seg, u);
    const int64_t seg_row = r.lo - int64_t(seg) * Ms;  // row inside the segment
    const int64_t rows = r.hi - r.lo, wid = r.c1 - r.c0, elems = rows * wid;
    const T* bias_cols = bias != nullptr ? bias + r.c0 : nullptr;
    // kNodeSum
    if (op == kNodeSum) {
      const int nt0 = int(r.c0 / a.tile_n), nt1 = int((r.c1 + a.tile_n - 1) / a.tile_n);
      if (!wait_node_tiles(a, t, int(r.lo / a.tile_m), nt0, nt1, e)) return;
      const int dst_node = seg / L;
      const unsigned long long paced_end = block_pace_reserve(a.pace, 0, uint64_t(L - 1) * elems * sizeof(T));
      const int64_t off = r.lo * N + r.c0;  // the unit in every node PE's addend
      if (Nn == 1) {
        block_sum<kEvict>(out + seg_row * N + r.c0, N, [&](int q) { return node_partial[q] + off; }, N, L, rows, wid,
                  bias_cols);
        __syncthreads();
        block_pace_wait(paced_end);  // the reads from my L - 1 node peers
        continue;
      }
      // The node partial, packed: into my receive slot (my own segment) or the stage slot bound for its owner. A
      // lone PE per node whose unit is whole rows sends straight from its addend, which then holds it contiguously.
      T* dst = (dst_node == node ? recv + int64_t(node) * Ms * N : stage + int64_t(dst_node) * Ms * N) + r.slot;
      const T* send = node_partial[0] + off;
      if (L > 1 || dst_node == node || wid != N) {
        block_sum<kEvict>(dst, wid, [&](int q) { return node_partial[q] + off; }, N, L, rows, wid,
                  static_cast<const T*>(nullptr));
        send = dst;
      }
      __syncthreads();
      block_pace_wait(paced_end);
      uint64_t* sig = a.recv_sig + node * a.max_units + u;
      if (dst_node == node) {  // my own segment's node partial stays here
        if (threadIdx.x == 0) { __threadfence(); st_release_sys(sig, e); }
        __syncthreads();
        continue;
      }
      // The node partial goes to the segment's owner, once it has arrived in this epoch (done reading the
      // previous call's receive slot).
      if (!block_wait_ge(a.ctx, a.bar + seg, e, kSiteBarrier, seg)) return;
      T* remote_slot = recv + int64_t(node) * Ms * N + r.slot;
      used_put |= put_signal_block(remote_slot, send, elems * sizeof(T), sig, e, seg, false,
                                   block_pace_reserve(a.pace, 1, elems * sizeof(T)));
      continue;
    }
    // kFinal: the node partials of my segment, summed in node order.
    // (other nodes' node partials come by put: NVSHMEM's wait; my node's own is a local store)
    for (int j = 0; j < Nn; ++j) {
      uint64_t* sig = a.recv_sig + j * a.max_units + u;
      if (!(j == node ? block_wait_ge(a.ctx, sig, e, kSiteRecv, j * a.max_units + u)
                      : block_wait_put_ge(a.ctx, sig, e, kSiteRecv, j * a.max_units + u)))
        return;
    }
    block_sum<kEvict>(out + seg_row * N + r.c0, N, [&](int j) { return recv + int64_t(j) * Ms * N + r.slot; }, wid, Nn, rows,
              wid, bias_cols);
    __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (used_put) nvshmem_quiet();
    if (!(a.flags & kRsSignalDone)) return;
    // The last block to finish tells my node's PEs that I no longer read their addends of this epoch
    // (ReduceScatter.input_buffer waits for it before a caller overwrites its input).
    __threadfence_system();
    const unsigned long long before = atomicAdd(a.exits + (e & 1), 1ull);
    if (before + 1 == gridDim.x) {
      a.exits[e & 1] = 0;  // reused in epoch e + 2, whose kernel starts after this one has ended
      for (int q = 0; q < L; ++q) signal_set(a.done + t.me, e, t.pe(node, q), true);
    }
  }
}

}  // namespace fs

// kRsEvictFirst: 16-bit sums only (the fused ops' partials; with fp32 the evict-first variant spilled).
#define FS_RS_KERNEL(NAME, T, EVICT)                                                          \
  extern "C" __global__ void __launch_bounds__(512) NAME(const __grid_constant__ RsArgs a) { \
    FS_RS_BODY(T, EVICT)                                                                      \
  }
#ifdef FS_DEVICE_PASS
#define FS_RS_BODY(T, EVICT)                          \
  if (EVICT && (a.flags & kRsEvictFirst))             \
    fs::reduce_scatter<T, EVICT>(a);                  \
  else                                                \
    fs::reduce_scatter<T, false>(a);
#else
#define FS_RS_BODY(T, EVICT)
#endif
FS_RS_KERNEL(fs_reduce_scatter_bf16, __nv_bfloat16, true)
FS_RS_KERNEL(fs_reduce_scatter_fp16, __half, true)
FS_RS_KERNEL(fs_reduce_scatter_fp32, float, false)
