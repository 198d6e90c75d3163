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

// ---------------------------------------------------------------------------------------------------------------
// Bulk copies through shared memory (Hopper cp.async.bulk, the 1-D form of TMA). One thread streams a byte range
// through a ring of kRingStages shared-memory stages: loads complete on one mbarrier per stage and bulk stores
// drain them, so a block keeps about three stages of loads in flight without holding them in registers. The
// register copies above keep ~64 KiB in flight per 512-thread block and then wait a whole memory latency: 30-37
// GB/s per block (GPU check comm_block_rates), too slow for the few blocks a fused op can spare beside its GEMM.
// Either side may be a peer's memory mapped over NVLink (nvshmem_ptr). The ring lives in the kernel's dynamic
// shared memory (after `reserved` bytes the kernel uses itself); a launch with too little leaves it invalid and
// the register copies run instead.
constexpr int kRingStages = 4;
constexpr uint32_t kRingMinStage = 4096;

struct Ring {
  uint64_t* full;         // [kRingStages] mbarriers in shared memory; null: no ring
  uint8_t* buf;           // kRingStages * stage_bytes
  uint32_t stage_bytes;   // multiple of 128
  uint32_t seq;           // stages consumed so far (the same count in every thread of the block)
  __device__ bool valid() const { return full != nullptr; }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Waits for the stage's loads (memory, not a peer's signal: they complete or the kernel faults).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gsrc, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem_dst)),
               "l"(gsrc), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ void bulk_store(void* gdst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst), "r"(smem_u32(smem_src)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most one bulk store group is still reading shared memory.
__device__ __forceinline__ void bulk_wait_reads_but_one() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}

__device__ __forceinline__ bool bulk_aligned(const void* a, const void* b, size_t nbytes) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | nbytes) & 15u) == 0;
}

// Whole block, once per kernel: the ring in dynamic shared memory after `reserved` bytes (invalid if what is left
// holds less than kRingStages stages of kRingMinStage bytes).
__device__ __forceinline__ Ring ring_init(uint8_t* smem, uint32_t reserved) {
  Ring r{nullptr, nullptr, 0, 0};
  const uint32_t base = smem_u32(smem), end = base + dynamic_smem_bytes();  // (shared-window addresses)
  const uint32_t bars = (base + reserved + 7u) & ~7u;
  const uint32_t buf = (bars + 8u * kRingStages + 127u) & ~127u;
  if (end < buf + kRingStages * kRingMinStage) return r;
  r.full = reinterpret_cast<uint64_t*>(smem + (bars - base));
  r.buf = smem + (buf - base);
  r.stage_bytes = ((end - buf) / kRingStages) & ~127u;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRingStages; ++s) mbar_init(r.full + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  return r;
}

// Thread 0 only: dst[0, nbytes) = src[0, nbytes) through the ring (16-byte aligned, bulk_aligned), every write
// complete on return (then fence_proxy_async_global before a generic release of a flag). The caller holds every
// other thread of the block at a __syncthreads until it returns. Stage reloads lag one store behind, so up to two
// stores drain while the other stages load.
__device__ inline void ring_copy(Ring& r, void* dst, const void* src, size_t nbytes) {
  const size_t S = r.stage_bytes;
  const size_t n = (nbytes + S - 1) / S;
  auto load = [&](size_t c) {
    const uint32_t s = uint32_t((r.seq + c) % kRingStages);
    const uint32_t b = uint32_t(nbytes - c * S < S ? nbytes - c * S : S);
    mbar_expect_tx(r.full + s, b);
    bulk_load(r.buf + s * S, static_cast<const uint8_t*>(src) + c * S, b, r.full + s);
  };
  fence_proxy_async_global();  // the source may have been made visible to this thread by a generic acquire
  for (size_t c = 0; c < n && c < size_t(kRingStages); ++c) load(c);
  for (size_t c = 0; c < n; ++c) {
    const uint32_t q = r.seq + uint32_t(c), s = q % kRingStages;
    mbar_wait(r.full + s, (q / kRingStages) & 1u);
    const uint32_t b = uint32_t(nbytes - c * S < S ? nbytes - c * S : S);
    bulk_store(static_cast<uint8_t*>(dst) + c * S, r.buf + s * S, b);
    if (c >= 1 && c - 1 + kRingStages < n) {
      bulk_wait_reads_but_one();  // the store of chunk c - 1 has read its stage
      load(c - 1 + kRingStages);
    }
  }
  bulk_wait_all_complete();
  r.seq += uint32_t(n);
}

// Whole block: copy nbytes (the ring when there is one and the pointers allow it, else register copies), every
// write done and fenced for a release of a flag by thread 0 when it returns.
__device__ __forceinline__ void block_copy_fast(Ring* r, void* dst, const void* src, size_t nbytes) {
  if (r != nullptr && r->valid() && bulk_aligned(dst, src, nbytes)) {
    if (threadIdx.x == 0) {
      ring_copy(*r, dst, src, nbytes);  // (advances r->seq)
      fence_proxy_async_global();
    } else {
      r->seq += uint32_t((nbytes + r->stage_bytes - 1) / r->stage_bytes);  // every thread keeps the same count
    }
  } else {
    block_copy(dst, src, nbytes);
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
// put it becomes a separate operation after a fence. `ring`: direct stores go through the bulk-copy ring. Returns true when the NVSHMEM put path was used (the caller
// then owes an nvshmem_quiet before reusing src).
__device__ __forceinline__ bool put_signal_block(void* dst, const void* src, size_t nbytes, uint64_t* sig, uint64_t v,
                                                 int pe, bool direct, unsigned long long paced_end,
                                                 Ring* ring = nullptr) {
  void* peer_dst = direct ? nvshmem_ptr(dst, pe) : nullptr;
  if (peer_dst != nullptr) {
    block_copy_fast(ring, peer_dst, src, nbytes);
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

}  // namespace fs
