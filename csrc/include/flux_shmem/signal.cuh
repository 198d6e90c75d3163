// Signals between PEs: release/acquire flag operations and a bounded spin-wait.
//
// Every kernel receives an fs::Ctx by value. A wait that exceeds ctx.timeout_ns records who waited on what in
// ctx.err->record (pinned host memory, readable by the host without synchronising) and then either traps (default: the
// CUDA context dies loudly, so no output is silently wrong) or returns false (ctx.trap_on_timeout == 0, used by
// tests to inspect the record and keep the process alive).
#pragma once
#include <cstdint>

namespace fs {

// Mirrored field by field in flux_shmem/kernels/abi.py (ErrorRecord); keep them in sync.
struct ErrorRecord {
  unsigned long long flag;      // 0: no error; 1: the fields below are complete
  unsigned long long expected;  // value the wait needed (>=)
  unsigned long long seen;      // value last observed
  unsigned long long addr;      // address of the signal word
  int code;                     // 1: signal wait timed out
  int pe;                       // PE that waited
  int site;                     // which wait (fs::Site below)
  int index;                    // signal index within its array (e.g. source PE * chunks + chunk)
  int block;
  int thread;
};

enum Site : int {
  kSiteBarrier = 1,      // arrival slot of a peer (index = peer PE)
  kSiteChunk = 2,        // all-gather chunk flag (index = source PE * chunks + chunk)
  kSiteRows = 3,         // GEMM tile-ready word (index = PE * tiles + m-tile * N-tiles + n-tile)
  kSiteRecv = 4,         // reduce-scatter receive signal (index = source node * units + unit)
  kSiteDone = 5,         // reduce-scatter "done reading my input" slot of a node peer (index = peer PE)
  kSiteSplitK = 7,       // split-K lock of a CTA tile (index = reduction slot * consumer warpgroups + warpgroup)
  kSiteTest = 9,         // test kernel
};

// Device-memory word that elects the first failing thread (atomics on host memory are not portable), and the
// host-mapped record it fills. One per process, shared by every kernel.
struct ErrorSlot {
  unsigned long long claim;  // 0 until a thread claims the record
  ErrorRecord* record;       // pinned host memory, device-accessible (UVA)
};

// Mirrored in flux_shmem/kernels/abi.py (Ctx).
struct Ctx {
  ErrorSlot* err;
  unsigned long long timeout_ns;
  int my_pe;
  int n_pes;
  int trap_on_timeout;
  int pad_;
};

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

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// After a __threadfence_system(): the fence orders the writes before it (NVSHMEM's own signal pattern); a release
// on top would be a second system-scope fence.
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Records the failure once per process (first claimer wins) and traps unless the context says otherwise.
__device__ __noinline__ void report_timeout(const Ctx& ctx, const uint64_t* sig, uint64_t expected, uint64_t seen,
                                            int site, int index) {
  ErrorSlot* slot = ctx.err;
  if (slot != nullptr && atomicCAS(&slot->claim, 0ull, 1ull) == 0ull) {
    volatile ErrorRecord* e = slot->record;
    e->expected = expected;
    e->seen = seen;
    e->addr = reinterpret_cast<unsigned long long>(sig);
    e->code = 1;
    e->pe = ctx.my_pe;
    e->site = site;
    e->index = index;
    e->block = blockIdx.x;
    e->thread = threadIdx.x;
    __threadfence_system();
    e->flag = 1ull;  // last: the host reads the fields only once it sees the flag
    __threadfence_system();
  }
  if (ctx.trap_on_timeout) __trap();
}

// True once another thread (any kernel of this process) has recorded an error: waits give up early then.
__device__ __forceinline__ bool error_raised(const Ctx& ctx) {
  return ctx.err != nullptr && *reinterpret_cast<volatile unsigned long long*>(&ctx.err->claim) != 0ull;
}

// Spin until load() >= expected, where load() is an acquire load of a signal word (any width, scope or
// signedness: T). Every 1024 polls the clock is checked: past ctx.timeout_ns the wait is reported (report_timeout,
// `addr` and `index` name the word) and fails, and it fails early once another thread has recorded an error.
// ctx.timeout_ns == 0 waits without a timeout (plain GEMMs outside a runtime, as CUTLASS's own waits do).
template <class T, class Load>
__device__ __forceinline__ bool spin_wait_ge(const Ctx& ctx, Load load, T expected, const void* addr, int site,
                                             int index) {
  T v = load();
  if (v >= expected) return true;
  const uint64_t start = global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    v = load();
    if (v >= expected) return true;
    if ((spin & 1023u) != 0u || ctx.timeout_ns == 0) continue;
    if (global_timer_ns() - start > ctx.timeout_ns) {
      report_timeout(ctx, static_cast<const uint64_t*>(addr), uint64_t(expected), uint64_t(v), site, index);
      return false;
    }
    if (error_raised(ctx)) return false;
  }
}

// Spin until *sig >= expected (acquire, system scope: writers may be other GPUs or NICs).
// Returns false on timeout (only when ctx.trap_on_timeout == 0) or when an error was already raised.
__device__ __forceinline__ bool wait_ge(const Ctx& ctx, const uint64_t* sig, uint64_t expected, int site, int index) {
  return spin_wait_ge(ctx, [sig] { return ld_acquire_sys(sig); }, expected, sig, site, index);
}

__device__ __forceinline__ int32_t ld_acquire_gpu_s32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace fs
