// Link emulation (FLUX_SHMEM_LINK_GBPS): when several PEs share one GPU, a "peer" transfer is a copy inside that
// GPU's memory, far faster than NVLink or InfiniBand. To measure overlap against a realistic link, every peer
// transfer of the comm engines reserves time on a per-PE virtual link (a clock in device memory: when the link is
// next free) and the block that made it waits until the reservation has elapsed, plus the latency, before raising
// the signal that publishes the data. Transfers of one PE over one link class thus run at most at the given
// bandwidth, back to back, in the order they reserve. Pacing is charged to the PE that moves the data: the
// sender of a store or put, the reader of a load (flux_shmem/ops/simulate.py models it so).
#pragma once
#include <cstdint>
#include "flux_shmem/signal.cuh"

namespace fs {

// Mirrored in flux_shmem/kernels/abi.py (Pace). fs_per_byte[c] == 0: link class c is not paced.
struct Pace {
  unsigned long long* clock;  // local device memory [2]: globaltimer ns at which link class c is free
  uint32_t fs_per_byte[2];    // class 0: inside a node (NVLink-like), class 1: between nodes (IB-like)
  uint32_t latency_ns[2];
};

// One thread: reserve the link for `bytes` from now (or from when it is next free) and return when the transfer
// would end (globaltimer ns, latency included); 0 when the class is not paced. Reserve before moving the data, so
// that the copy itself runs inside the reserved time, as a real transfer streams while it holds the link.
__device__ __forceinline__ unsigned long long pace_reserve(const Pace& p, int cls, uint64_t bytes) {
  if (p.clock == nullptr || p.fs_per_byte[cls] == 0 || bytes == 0) return 0;
  const unsigned long long dur = bytes * p.fs_per_byte[cls] / 1000000ull;
  const unsigned long long now = global_timer_ns();
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(p.clock + cls), start;
  for (;;) {
    start = seen > now ? seen : now;
    const unsigned long long prev = atomicCAS(p.clock + cls, seen, start + dur);
    if (prev == seen) break;
    seen = prev;
  }
  return start + dur + p.latency_ns[cls];
}

__device__ __forceinline__ void pace_wait(unsigned long long end) {
  if (end == 0) return;
  while (global_timer_ns() < end) __nanosleep(256);
}

// Whole block: thread 0 reserves, every thread gets the end time (pass it to block_pace_wait after the copy).
__device__ __forceinline__ unsigned long long block_pace_reserve(const Pace& p, int cls, uint64_t bytes) {
  if (p.clock == nullptr || p.fs_per_byte[cls] == 0 || bytes == 0) return 0;
  __shared__ unsigned long long end;
  __syncthreads();
  if (threadIdx.x == 0) end = pace_reserve(p, cls, bytes);
  __syncthreads();
  return end;
}

// Whole block: wait until `end`, then the block goes on together.
__device__ __forceinline__ void block_pace_wait(unsigned long long end) {
  if (end == 0) return;
  if (threadIdx.x == 0) pace_wait(end);
  __syncthreads();
}

}  // namespace fs
