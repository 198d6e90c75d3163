"""The CUTLASS GEMM kernel configurations that exist: tile, cluster and schedule, one named entry each.

Every GEMM family (csrc/ag_gemm.cu, csrc/gemm_rs.cu) is built once per configuration it is used with: the entry's
`defines` become nvcc -D flags (FS_GEMM_* in csrc/include/flux_shmem/gemm_config.cuh) and part of the build's cache key
(flux_shmem/kernels/build.py), and the build is made on first use or ahead of time
(`python -m flux_shmem.build --config all`). Which configuration runs a given problem is decided at run time, per
(M, N, K, dtype, layout, SM count), by flux_shmem/kernels/config.py; swizzle and K splits are run-time arguments of
every build, not configurations.

Pure Python (no torch): the chooser and the CPU tests import it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Dict, Tuple

from ..errors import FluxShmemError

SCHEDULES = ("cooperative", "pingpong")
TILE_K = 64       # K-tile of the 16-bit builds: 128 bytes of bf16/fp16 per row, the widest TMA/wgmma swizzle
TILE_K_FP8 = 128  # the fp8 builds' (FS_GEMM_TILE_K): 128 bytes of e4m3
MAX_SPLITS = 16  # the cooperative kernels' bound (OrderedTileScheduler::kMaxSplits)
# What a split means to the scheduler (csrc/include/flux_shmem/gemm_schedule.cuh); part of the fingerprint, so tuned
# choices measured under another meaning are stale. v1: equal K splits of the last wave's tiles; v2: stream-K over
# the last two waves.
SPLIT_SCHEDULE = "stream-k-2wave-v2"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel configuration. `tile_m x tile_n` is the CTA tile (cooperative: both consumer warpgroups on one
    tile) or each consumer warpgroup's tile (pingpong: two tiles in flight per CTA, one's epilogue overlapping the
    other's mainloop). Clusters of `cluster_m x cluster_n` CTAs share operand loads (TMA multicast)."""

    name: str
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    schedule: str

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{self.name}: schedule {self.schedule!r} is not one of {SCHEDULES}")

    @property
    def pingpong(self) -> bool:
        return self.schedule == "pingpong"

    @property
    def max_splits(self) -> int:
        """Largest K split: the scheduler's split-K reduction runs in the cooperative kernel only."""
        return 1 if self.pingpong else MAX_SPLITS

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def defines(self) -> Tuple[str, ...]:
        """The build's -D macros (without the -D)."""
        return (f"FS_GEMM_TILE_M={self.tile_m}", f"FS_GEMM_TILE_N={self.tile_n}",
                f"FS_GEMM_CLUSTER_M={self.cluster_m}", f"FS_GEMM_CLUSTER_N={self.cluster_n}",
                f"FS_GEMM_PINGPONG={int(self.pingpong)}")

    def tiles(self, m: int, n: int) -> Tuple[int, int]:
        """(tiles_m, tiles_n) of an m x n output."""
        return -(-m // self.tile_m), -(-n // self.tile_n)

    def describe(self) -> str:
        return f"{self.tile_m}x{self.tile_n} {self.schedule}, cluster {self.cluster_m}x{self.cluster_n}"

    @property
    def accumulator_regs(self) -> int:
        """fp32 accumulator registers per thread of a consumer warpgroup (128 threads): cooperative, the two
        warpgroups share the tile; pingpong, each holds a whole tile."""
        return self.tile_m * self.tile_n // 128 // (1 if self.pingpong else 2)

    def runs_fp8(self, fast_accum: bool) -> bool:
        """Whether the fp8 build of this configuration runs from registers. CUTLASS's default fp8 schedule keeps
        a second accumulator (each K-block's wgmma results, promoted into the first every few blocks), so both
        must fit the consumer's 232 registers: at 128 registers each they spill (cuobjdump of the 128x256
        cooperative build: 365 local stores, stack 352 B, where its bf16 build has 32 and 32 B; on the H100 it
        ran at 0.36x torch._scaled_mm). FP8FastAccum keeps one accumulator, like the 16-bit builds."""
        return fast_accum or 2 * self.accumulator_regs <= FP8_PROMOTED_MAX_ACC_REGS


def _entries(*cfgs: KernelConfig) -> Dict[str, KernelConfig]:
    return {c.name: c for c in cfgs}


# Order matters only for ties in the chooser (earlier wins). The default came out best on large LLM shapes
# (benchmarks/RESULTS.md, 2026-12-02); the others cover the shard shapes of tensor parallelism (issue 11): 256x128
# for tall problems, 128x128 for more tiles per wave, pingpong for short K (the epilogue hides behind the other
# warpgroup's mainloop).
CONFIGS: Dict[str, KernelConfig] = _entries(
    KernelConfig("128x256_c2x1", 128, 256, 2, 1, "cooperative"),
    KernelConfig("256x128_c1x2", 256, 128, 1, 2, "cooperative"),
    KernelConfig("128x128_c2x1", 128, 128, 2, 1, "cooperative"),
    KernelConfig("128x128_c2x1_pp", 128, 128, 2, 1, "pingpong"),
)
DEFAULT = "128x256_c2x1"
# Two accumulators of at most 64 registers each leave the promoting fp8 mainloop room for its fragments and
# addresses within 232 (128x128 cooperative: 8 local stores, as many as its bf16 build).
FP8_PROMOTED_MAX_ACC_REGS = 128
ENV_FP8_FAST_ACCUM = "FLUX_SHMEM_FP8_FAST_ACCUM"


def fp8_fast_accum() -> bool:
    """Whether fp8 builds use CUTLASS's FP8FastAccum schedules (FLUX_SHMEM_FP8_FAST_ACCUM=1; default off: the
    promoting schedule, fp32 sums of every few K-blocks, as torch._scaled_mm's use_fast_accum=False)."""
    return os.environ.get(ENV_FP8_FAST_ACCUM, "") == "1"


def tuning_dtype(dtype_name: str) -> str:
    """The tuning cache's dtype field for GEMMs of `dtype_name`: e4m3 measured with FP8FastAccum builds is kept
    apart ('e4m3fast'), as the two schedules run different kernels."""
    return "e4m3fast" if dtype_name == "e4m3" and fp8_fast_accum() else dtype_name


def names_for(dtype_name: str) -> Tuple[str, ...]:
    """The configurations a GEMM of `dtype_name` ('bf16', 'fp16', 'e4m3') may run: every one, but for e4m3 under
    the promoting schedule only those whose accumulators fit (`KernelConfig.runs_fp8`)."""
    if dtype_name != "e4m3":
        return names()
    fast = fp8_fast_accum()
    return tuple(n for n, c in CONFIGS.items() if c.runs_fp8(fast))


def default_for(dtype_name: str) -> str:
    """The default configuration of `dtype_name`'s builds (the first of `names_for` when DEFAULT is not one)."""
    allowed = names_for(dtype_name)
    return DEFAULT if DEFAULT in allowed else allowed[0]


def get(config: "str | KernelConfig | None" = None) -> KernelConfig:
    """The registry entry named `config` (None: the default); a KernelConfig must be one of the entries."""
    if config is None:
        return CONFIGS[DEFAULT]
    if isinstance(config, KernelConfig):
        if CONFIGS.get(config.name) != config:
            raise FluxShmemError(f"kernel configuration {config} is not in the registry "
                                 "(flux_shmem/kernels/registry.py CONFIGS)")
        return config
    try:
        return CONFIGS[config]
    except KeyError:
        raise FluxShmemError(f"unknown GEMM kernel configuration {config!r}: one of {', '.join(CONFIGS)}") from None


def tile_k(dtype_name: str = "bf16") -> int:
    """The K-tile of the builds for operands of `dtype_name` ('bf16', 'fp16' or 'e4m3'): the same entries serve
    every dtype, only the K-tile differs."""
    return TILE_K_FP8 if dtype_name == "e4m3" else TILE_K


def names() -> Tuple[str, ...]:
    return tuple(CONFIGS)


def fingerprint() -> str:
    """A short hash of every entry and of SPLIT_SCHEDULE: a tuning cache made with other entries (or meanings of
    names or splits) is stale."""
    text = ";".join(f"{c.name}={','.join(c.defines)}" for c in CONFIGS.values()) + f";split={SPLIT_SCHEDULE}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]
