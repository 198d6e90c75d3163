// CUTLASS extensions shared by the GEMM families (ag_gemm.cu, gemm_rs.cu), written against CUTLASS 4.2's sm90
// extension points, one header per extension point (this file includes them in order; include this one):
//   * gemm_scheduler.cuh: OrderedTileScheduler, a persistent tile scheduler (extends PersistentTileSchedulerSm90)
//     that visits M-tiles in the order of a device array, rasters along N with swizzle groups but no padding tiles,
//     and splits K at run time (cooperative kernels); plugged in with the tag OrderedPersistentScheduler<split_k>
//     through a specialization of cutlass::gemm::kernel::detail::TileSchedulerSelector.
//   * gemm_mainloop.cuh: AgMainloop<Base>, the sm90 TMA warp-specialized mainloop whose producer first waits for the
//     all-gather chunks covering the tile's rows.
//   * gemm_epilogue.cuh: RsEpilogue<Base>, the sm90 TMA warp-specialized epilogue that marks each tile ready (its
//     word in tile_ready set to the epoch) once the tile's stores have landed; the fp8 scaled epilogue.
//   * gemm_config.cuh: GemmConfig<...>, the kernel types of one build (tile, cluster and cooperative or pingpong
//     schedule from the FS_GEMM_* macros set by the configuration registry, flux_shmem/kernels/registry.py; D = acc
//     + bias[n]), and FS_GEMM_BUILD_TYPES, the build's kernel list both families define their kernels over.
//   * gemm_host.cuh (FS_HOST_PASS only): error string, ABI introspection, the TMA-descriptor driver shim and the
//     generic "fill Params + launch geometry" routine.
//
// Device side code only uses plain loads/stores on signal words (no NVSHMEM).
#pragma once

#if defined(FS_HOST_PASS) && !defined(CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL)
// TMA descriptors are encoded on the host through cuTensorMapEncodeTiled. Call it "directly" and resolve it from
// libcuda.so.1 at run time (the shim in gemm_host.cuh): the host library then loads without a driver
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
}  // namespace gemm
}  // namespace fs

#include "flux_shmem/gemm_scheduler.cuh"
#include "flux_shmem/gemm_mainloop.cuh"
#include "flux_shmem/gemm_epilogue.cuh"
#include "flux_shmem/gemm_config.cuh"
#include "flux_shmem/gemm_host.cuh"
