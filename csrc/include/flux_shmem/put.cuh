// Moving a contiguous byte range to a peer and raising its signal: direct load/store over NVLink when the peer's
// memory is mapped (nvshmem_ptr != null and the caller allows it), NVSHMEM put-with-signal otherwise (the path
// that crosses nodes; `direct = false` forces it on one node so that path can be tested anywhere).
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cstdint>
#include "flux_shmem/pace.cuh"
#include "flux_shmem/signal.cuh"

namespace fs {

// All threads of the block copy nbytes. 16-byte vectors when both pointers and the size allow it, eight loads in
// flight per thread before the first store (64 KiB per 512-thread block: one block streams ~45 GB/s with four).
__device__ __forceinline__ void block_copy(void* dst, const void* src, size_t nbytes) {
  const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | nbytes) & 15u) == 0;
  if (vec) {
    constexpr int kIlp = 8;
    const size_t n = nbytes / 16;
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    size_t i = threadIdx.x;
    for (; i + (kIlp - 1) * blockDim.x < n; i += kIlp * blockDim.x) {
      uint4 v[kIlp];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) v[j] = s[i + j * blockDim.x];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) d[i + j * blockDim.x] = v[j];
    }
    for (; i < n; i += blockDim.x) d[i] = s[i];
  } else {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    for (size_t i = threadIdx.x; i < nbytes; i += blockDim.x) d[i] = s[i];
  }
}

// One thread: set a peer's signal word (symmetric address) to v with release semantics.
__device__ __forceinline__ void signal_set(uint64_t* sig, uint64_t v, int pe, bool direct) {
  if (direct) {
    uint64_t* p = static_cast<uint64_t*>(nvshmem_ptr(sig, pe));
    if (p != nullptr) {
      __threadfence_system();
      st_release_sys(p, v);
      return;
    }
  }
  nvshmemx_signal_op(sig, v, NVSHMEM_SIGNAL_SET, pe);
}

// Whole block: copy nbytes from src to the symmetric dst on pe, then set pe's signal to v. The signal is observed
// only after the data (direct: barrier + system fence before a release store; put: NVSHMEM's ordering). `direct`
// allows stores through the NVLink mapping where pe's memory is mapped; else (and for other nodes) an NVSHMEM put.
// `paced_end` (block_pace_reserve; 0: not paced): the signal also waits for the emulated transfer's end, so with a
// put it becomes a separate operation after a fence. Returns true when the NVSHMEM put path was used (the caller
// then owes an nvshmem_quiet before reusing src).
__device__ __forceinline__ bool put_signal_block(void* dst, const void* src, size_t nbytes, uint64_t* sig, uint64_t v,
                                                 int pe, bool direct, unsigned long long paced_end) {
  void* peer_dst = direct ? nvshmem_ptr(dst, pe) : nullptr;
  if (peer_dst != nullptr) {
    block_copy(peer_dst, src, nbytes);
    __syncthreads();
    block_pace_wait(paced_end);
    if (threadIdx.x == 0) signal_set(sig, v, pe, true);
    __syncthreads();
    return false;
  }
  if (paced_end == 0) {
    nvshmemx_putmem_signal_nbi_block(dst, src, nbytes, sig, v, NVSHMEM_SIGNAL_SET, pe);
    return true;
  }
  nvshmemx_putmem_nbi_block(dst, src, nbytes, pe);
  if (threadIdx.x == 0) {
    pace_wait(paced_end);
    nvshmem_fence();
    nvshmemx_signal_op(sig, v, NVSHMEM_SIGNAL_SET, pe);
  }
  __syncthreads();
  return true;
}

// Thread 0 waits, the block follows. False (for every thread) when the wait failed.
__device__ __forceinline__ bool block_wait_ge(const Ctx& ctx, const uint64_t* sig, uint64_t expected, int site,
                                              int index) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = wait_ge(ctx, sig, expected, site, index) ? 1 : 0;
  __syncthreads();
  const bool r = ok != 0;
  __syncthreads();
  return r;
}

// wait_ge, optionally sleeping ~200 ns between polls after the first: a comm kernel's many polling threads then
// stop hammering L2 with acquire loads while the GEMM beside it needs L2 (RsArgs.flags kRsPollSleep).
__device__ __forceinline__ bool wait_ge_polite(const Ctx& ctx, const uint64_t* sig, uint64_t expected, int site,
                                               int index, bool sleep) {
  if (!sleep) return wait_ge(ctx, sig, expected, site, index);
  uint32_t polls = 0;
  return spin_wait_ge(ctx, [sig, &polls] {
    if (polls++ != 0) __nanosleep(200);
    return ld_acquire_sys(sig);
  }, expected, sig, site, index);
}

// Thread 0 waits for a signal that an NVSHMEM put-with-signal may have raised (data from another node, any forced
// put), the block follows. Once the signal is seen, NVSHMEM's own test (satisfied at once) runs the transport's
// consistency step at this target: on proxy (IB) transports the data signalled before it is only then guaranteed
// visible to our loads; on P2P the step is the fence it includes. False (for every thread) when the wait failed.
__device__ __forceinline__ bool block_wait_put_ge(const Ctx& ctx, uint64_t* sig, uint64_t expected, int site,
                                                  int index) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = wait_ge(ctx, sig, expected, site, index) ? 1 : 0;
    if (ok) nvshmem_uint64_test(sig, NVSHMEM_CMP_GE, expected);
  }
  __syncthreads();
  const bool r = ok != 0;
  __syncthreads();
  return r;
}

}  // namespace fs
