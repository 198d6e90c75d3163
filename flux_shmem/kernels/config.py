"""Which GEMM kernel configuration, scheduler swizzle and K split run one problem.

    choice = choose(m, n, k, "bf16", "nk", sm_count=132)            # or dtype=torch.bfloat16
    choice.config, choice.swizzle, choice.split, choice.describe()

Three sources, in this order:
  * forced: `FLUX_SHMEM_GEMM_CONFIG="config=128x128_c2x1_pp,swizzle=1,split=1"` (any subset of the keys; a bare
    name means config=NAME) overrides what it names, for experiments;
  * tuned: the tuning cache (flux_shmem/kernels/tune_cache.py, written by `python -m flux_shmem.tune` or, with
    FLUX_SHMEM_TUNE=1, by the first plain GEMM of a shape, kernels/plain.py) holds the measured best for this GPU,
    SM count, CUDA version, dtype, layout and shape;
  * heuristic: a model of the persistent kernel's waves (below), from the tile counts and the SM count only, so a
    new GPU or an SM budget (MPS, green contexts, SMs left to communication) needs no table.

The model. A configuration runs T cluster tiles on P persistent clusters (CUTLASS's occupancy rule on `sm_count`);
each cluster tile costs k-tiles x (tile FLOPs / a nominal per-SM rate / the configuration's efficiency) plus its
epilogue. Whole waves cost ceil(T / P) tile times. With a split S > 1 (cooperative kernels only) the last partial
wave and the whole wave before it run as stream-K (`tail_plan`, the kernel's fs::plan_tail): their K-tiles are cut
evenly into U = min(P, tail tiles x S) ranges, one per cluster, and a tile cut into pieces adds them up in a serial
reduction of fp32 partial tiles. Ranges that start at any K-tile put the clusters at as many K offsets, so their
A and B tiles come from DRAM once per tile (STREAMK_DRAM_SHARE) where a wave of whole tiles shares them in L2
(4096 x 1280 x 8192: 205 us, as whole tiles). With `chunks` q the ranges start only at q chunk boundaries of a
tile: the clusters walk K at q offsets and each offset's clusters share their K-slabs like a wave (q waves' worth
of bytes, `_tail_dram_bytes`), at the price of ranges up to a chunk longer. The tail costs the larger of its
compute (its longest range) and its bytes; for each split the model takes the best of CHUNK_OPTIONS and q = k-tiles
(unaligned). Worth it when the last wave is far from full (1024 x 4608 x 12288: 1.09 waves ran in 206 us, whole
tiles ~305). S matters only below one wave (it bounds the pieces per tile); above, every S > 1 is the same plan. The
model ranks candidates; it does not predict absolute times well (estimate_us is a rough figure). A candidate
replaces the default (128x256 cooperative, swizzle 8, no split) only when the model expects it to be faster by more
than MARGIN, since the default is the measured one.

Fused ops pass `group_rows`: the scheduler's swizzle group (swizzle clusters of M-tiles walking across N together)
must fit in that many rows (one all-gather chunk or reduce-scatter segment), so that a wave only needs rows already
there; the group never gets smaller than one cluster. Pure Python: no torch needed (the tuning cache lookup needs
the GPU's name, from torch when `device` is not given).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

from ..errors import FluxShmemError
from . import registry
from .registry import KernelConfig

ENV_FORCE = "FLUX_SHMEM_GEMM_CONFIG"
SWIZZLES = (1, 2, 4, 8)
DEFAULT_SWIZZLE = 8
DTYPES = ("bf16", "fp16", "e4m3")  # operand dtypes; e4m3 GEMMs output bf16
LAYOUTS = ("kn", "nk")
FP8_LAYOUT_ERROR = ("fp8 GEMMs take B as [N, K] row-major ('nk', K contiguous): sm90 fp8 wgmma reads only "
                    "K-major operands; transpose the weight once to [N, K] (w.t().contiguous() of a [K, N] w) "
                    "and pass its .t()")
MARGIN = 0.03  # relative gain the model must see before leaving the default configuration

# Model constants (nominal, one set for every GPU: the model ranks candidates, the tuner measures).
SM_TFLOPS = 5.0          # dense bf16/fp16 tensor-core rate per SM a good kernel sustains (~660 TF on 132 SMs)
FP8_SPEEDUP = 2.0        # e4m3 wgmma's rate over bf16's (nominal, as the rest)
EFFICIENCY = {           # per-k-step efficiency relative to 128x256 cooperative
    ("cooperative", 128, 256): 1.0, ("cooperative", 256, 128): 1.0,
    ("cooperative", 128, 128): 0.90, ("pingpong", 128, 128): 0.95,
}
EPILOGUE_US = 0.3        # fixed cost of a cooperative epilogue (not overlapped with the tile's own mainloop)
STORE_GBPS = 400.0       # per-SM rate of the epilogue's stores (bytes / us = GB/s / 1000 * 1e6 / 1e6)
REDUCE_STEP_US = 0.5     # per split: lock hand-off of the serial split-K reduction
REDUCE_GBPS = 150.0      # per-SM rate of reading/writing fp32 partial tiles
LAUNCH_US = 4.0          # kernel start and tail, the same for every candidate
DRAM_GBPS = 3500.0       # floor: A, B and D cross DRAM at least once
# The stream-K tail's clusters run at different K offsets, so they share little of A and B in L2 (a wave of whole
# tiles walks K in step): its tiles' operand bytes cross DRAM nearly once per tile. Fitted on the H100's tp-shard
# part 1/4 (2026-12-06, 48 stream-K runs without whole waves before the tail: measured time x DRAM_GBPS / those
# bytes, median 0.88, 0.93-1.04 where the tail is not compute-bound); e.g. 4096x1280x8192, 80 tiles of 256x256 over
# K = 8192: 671 MB, 205 us measured where the compute model said 135 and whole tiles 204.
STREAMK_DRAM_SHARE = 0.9
# Chunk counts the model tries for aligned stream-K ranges (gemm_schedule.cuh): few offsets share L2 best, more
# balance the ranges better; 0 (ranges start at any K-tile) is always a candidate too.
CHUNK_OPTIONS = (2, 3, 4, 6, 8)
# Aligned ranges have not run on a GPU yet (issue 24): until RESULTS.md shows them ahead of unaligned ones and of
# cuBLAS, the heuristic keeps chunks = 0 and only the tuner (which measures both) and FLUX_SHMEM_GEMM_CONFIG's
# chunks= key use them. The model of them is ready: candidates(..., chunks=None).
HEURISTIC_CHUNKS: Optional[int] = 0  # None: the model's best alignment


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs a GEMM: a registry configuration, the scheduler swizzle, the K split of the last wave's tiles."""

    config: str
    swizzle: int
    split: int
    source: str   # "heuristic", "tuned" or "forced"
    reason: str
    estimate_us: Optional[float] = None  # the model's figure (heuristic) or the measured median (tuned)
    chunks: int = 0  # the stream-K tail's ranges start at this many chunk boundaries per tile (0: at any K-tile)

    @property
    def kernel_config(self) -> KernelConfig:
        return registry.get(self.config)

    def describe(self) -> str:
        chunks = f" chunks={self.chunks}" if self.chunks else ""
        return f"{self.config} swizzle={self.swizzle} split={self.split}{chunks} ({self.source}: {self.reason})"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The model's view of one candidate."""

    config: KernelConfig
    swizzle: int
    split: int
    us: float            # modelled time (ranking)
    tiles: int           # cluster tiles
    clusters: int        # persistent clusters
    waves: float         # tiles / clusters
    tail_tiles: int      # tiles of the stream-K tail (0 when split == 1)
    tail_units: int = 0  # the tail's ranges (clusters sharing its K-tiles)
    swizzle_note: str = ""
    chunks: int = 0      # aligned ranges: chunk boundaries per tile they start at (0: any K-tile)

    def summary(self) -> str:
        s = f"{self.tiles} {self.config.tile_m}x{self.config.tile_n} cluster tiles = {self.waves:.2f} waves"
        if self.tail_units:
            s += f", last {self.tail_tiles} as stream-K over {self.tail_units} clusters"
            s += f" at {self.chunks} K offsets" if self.chunks else ""
        return s + f", model {self.us:.0f} us"


def tail_chunks(k_tiles: int, chunks: int) -> int:
    """The chunks per tile the tail's ranges may start at: fs::tail_chunks (0 or more than k_tiles: k_tiles)."""
    return k_tiles if chunks <= 0 or chunks > k_tiles else chunks


def tail_plan(tiles: int, clusters: int, split: int, k_tiles: int, chunks: int = 0) -> Tuple[int, int]:
    """(dp_tiles, tail_units): the kernel's fs::plan_tail (csrc/include/flux_shmem/gemm_schedule.cuh). Whole tiles
    for all waves but the last whole one; the rest's chunks (`tail_chunks` per tile) in tail_units even ranges (0:
    no tail)."""
    if split <= 1 or tiles % clusters == 0:
        return tiles, 0
    waves = tiles // clusters
    dp = (waves - 1) * clusters if waves >= 1 else 0
    tail = tiles - dp
    return dp, min(clusters, tail * split, tail * tail_chunks(k_tiles, chunks))


def tail_ranges(tail: int, units: int, k_tiles: int, chunks: int = 0) -> List[Tuple[int, int]]:
    """The tail's ranges as (first, end) stream K-tiles, range c over chunks [c n / U, (c+1) n / U) (fs::unit_at's
    range_start / chunk_start)."""
    q = tail_chunks(k_tiles, chunks)
    n = tail * q

    def start(j: int) -> int:
        return j // q * k_tiles + j % q * k_tiles // q
    return [(start(c * n // units), start((c + 1) * n // units)) for c in range(units)]


def dtype_name(dtype) -> str:
    """'bf16' / 'fp16' / 'e4m3' from those strings or a torch dtype (without importing torch)."""
    text = str(dtype)
    names = {"bf16": "bf16", "fp16": "fp16", "e4m3": "e4m3", "torch.bfloat16": "bf16", "torch.float16": "fp16",
             "torch.float8_e4m3fn": "e4m3", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3"}
    if text not in names:
        if "e5m2" in text:
            raise FluxShmemError(f"CUTLASS fp8 GEMMs take float8_e4m3fn operands, not {dtype}: cast to "
                                 "float8_e4m3fn (x.to(torch.float8_e4m3fn), rescaling for its range)")
        raise FluxShmemError(f"CUTLASS GEMMs take bfloat16 or float16 operands (or float8_e4m3fn with scales), not "
                             f"{dtype}")
    return names[text]


def elem_bytes(dt: str) -> tuple:
    """(bytes of an A/B element, bytes of a D element) of operands `dt` (a dtype_name)."""
    return (1, 2) if dt == "e4m3" else (2, 2)


def persistent_clusters(cfg: KernelConfig, sm_count: int) -> int:
    """Clusters of the persistent grid on `sm_count` SMs: CUTLASS's rule (PersistentTileSchedulerSm90Params::
    get_max_cta_occupancy: whole clusters per GPC of up to 18 SMs, at most sm_count CTAs), which the kernel's launch
    grid follows."""
    if sm_count <= 0:
        raise FluxShmemError(f"sm_count must be > 0, got {sm_count}")
    size = cfg.cluster_size
    if size == 1:
        return sm_count
    per_gpc = 18
    full_gpcs = 1 if sm_count < per_gpc else sm_count // per_gpc
    ctas = full_gpcs * (per_gpc - per_gpc % size)
    residual = 0 if sm_count < per_gpc else sm_count % per_gpc
    ctas += residual - residual % size
    ctas = min(ctas, sm_count)
    return max(1, ctas // size)


def cluster_tiles(cfg: KernelConfig, m: int, n: int) -> Tuple[int, int]:
    """(cluster tiles along M, along N)."""
    tm, tn = cfg.tiles(m, n)
    return -(-tm // cfg.cluster_m), -(-tn // cfg.cluster_n)


def swizzle_cap_for_n(n: Optional[int]) -> int:
    """The widest swizzle group worth having for an output N columns wide. Measured on the H200 (issue 11, bf16,
    K = 8192, 128x256 tiles): at N = 1280 and 3584 a group of one cluster row (swizzle 1) ran 0.82 / 0.98 of cuBLAS
    against 0.54 / 0.85 with 8; at N = 7168 swizzle 4 ran 1.00 against 0.84; from N = 8192 up, 8 was within
    0.96-1.01. A narrow problem's whole B panel is read by every group anyway, so wide groups only spread the
    A rows of a wave over more of L2."""
    if n is None:
        return DEFAULT_SWIZZLE
    if n <= 4096:
        return 1
    if n <= 7168:
        return 4
    return DEFAULT_SWIZZLE


def swizzle_for(cfg: KernelConfig, m: int, group_rows: Optional[int] = None, n: Optional[int] = None
                ) -> Tuple[int, str]:
    """(swizzle, note): DEFAULT_SWIZZLE clusters of M-tiles per group, fewer when the output is narrow
    (`swizzle_cap_for_n`), when the group would exceed `group_rows` rows or the problem's M clusters; never below 1
    (one cluster, which the note then reports when it exceeds group_rows)."""
    rows_per_cluster = cfg.tile_m * cfg.cluster_m
    clusters_m = -(-m // rows_per_cluster)
    s = swizzle_cap_for_n(n)
    while s > 1 and s > clusters_m:
        s //= 2
    note = ""
    if group_rows is not None:
        if group_rows <= 0:
            raise FluxShmemError(f"group_rows must be > 0, got {group_rows}")
        while s > 1 and s * rows_per_cluster > group_rows:
            s //= 2
        if rows_per_cluster > group_rows:
            note = f"one cluster ({rows_per_cluster} rows) exceeds group_rows={group_rows}"
    return s, note


def _efficiency(cfg: KernelConfig) -> float:
    return EFFICIENCY.get((cfg.schedule, cfg.tile_m, cfg.tile_n), 0.85)


def _tail_dram_bytes(cfg: KernelConfig, cm: int, cn: int, group: int, clusters: int, tail: int, k: int,
                     a_bytes: int, offsets: int) -> float:
    """A and B bytes the stream-K tail moves through DRAM: each tile's own (STREAMK_DRAM_SHARE x tail tiles x their
    rows and columns x K) when its clusters walk K at many offsets; with few offsets, each offset's clusters read
    one wave's rows and columns together (`offsets` x the tail's waves x a wave's), whichever is less."""
    rows_c, cols_c = cfg.cluster_m * cfg.tile_m, cfg.cluster_n * cfg.tile_n
    own = STREAMK_DRAM_SHARE * tail * (rows_c + cols_c) * k * a_bytes
    g = max(1, min(group, cm))
    wave = min(clusters, cm * cn)
    rows = min(cm, max(g, -(-wave // cn))) * rows_c  # a wave of the raster: groups of g M-clusters across N
    cols = min(cn, -(-wave // g)) * cols_c
    shared = offsets * tail / max(1, wave) * (rows + cols) * k * a_bytes
    return min(own, shared)


def estimate(cfg: KernelConfig, m: int, n: int, k: int, sm_count: int, split: int = 1, *, elem_bytes: int = 2,
             group_rows: Optional[int] = None, dtype: str = "bf16", chunks: Optional[int] = 0) -> Estimate:
    """The model's time for one configuration and K split (see the module docstring). elem_bytes: of D; dtype:
    the operands' (e4m3: K-tiles of registry.TILE_K_FP8 at FP8_SPEEDUP times the rate); chunks: the stream-K
    ranges' alignment (0: any K-tile; None: the best of CHUNK_OPTIONS and 0 in the model)."""
    if chunks is None:
        opts = [0] + [q for q in CHUNK_OPTIONS if q < -(-k // registry.tile_k(dtype))]  # q >= k-tiles is 0
        ests = [estimate(cfg, m, n, k, sm_count, split, elem_bytes=elem_bytes, group_rows=group_rows, dtype=dtype,
                         chunks=q) for q in opts]
        return min(ests, key=lambda e: (round(e.us, 6), e.chunks == 0, e.chunks))  # a tie: aligned, fewest offsets
    if chunks < 0:
        raise FluxShmemError(f"chunks must be >= 0 (0: stream-K ranges start at any K-tile), got {chunks}")
    if min(m, n, k) <= 0:
        raise FluxShmemError(f"bad GEMM size {m}x{n}x{k}")
    if not 1 <= split <= cfg.max_splits:
        raise FluxShmemError(f"{cfg.name}: split must be in [1, {cfg.max_splits}], got {split}")
    cm, cn = cluster_tiles(cfg, m, n)
    tiles = cm * cn
    clusters = persistent_clusters(cfg, sm_count)
    tile_k = registry.tile_k(dtype)
    k_tiles = -(-k // tile_k)
    split = min(split, k_tiles)
    rate = SM_TFLOPS * (FP8_SPEEDUP if dtype == "e4m3" else 1.0)
    step_us = cfg.tile_m * cfg.tile_n * tile_k * 2 / (rate * 1e6 * _efficiency(cfg))
    out_bytes = cfg.tile_m * cfg.tile_n * elem_bytes
    epi_us = (EPILOGUE_US + out_bytes / (STORE_GBPS * 1e3)) if not cfg.pingpong else 0.1 * EPILOGUE_US
    tile_us = k_tiles * step_us + epi_us
    q = tail_chunks(k_tiles, chunks)
    dp, units = tail_plan(tiles, clusters, split, k_tiles, chunks)
    swizzle, note = swizzle_for(cfg, m, group_rows, n)
    if units == 0:
        us, tail, chunks = math.ceil(tiles / clusters) * tile_us, 0, 0
    else:
        tail = tiles - dp
        pieces = -(-units // tail) + (0 if units % tail == 0 else 1)  # most pieces of one tile
        reduce_us = pieces * (REDUCE_STEP_US + cfg.tile_m * cfg.tile_n * 4 / (REDUCE_GBPS * 1e3))
        ranges = tail_ranges(tail, units, k_tiles, chunks)
        longest = max(b - a for a, b in ranges)
        compute_us = longest * step_us + math.ceil(tail / units) * epi_us
        offsets = len({a % k_tiles for a, _ in ranges})  # K offsets the clusters start (and so walk) at
        dram_us = _tail_dram_bytes(cfg, cm, cn, swizzle, clusters, tail, k, 1 if dtype == "e4m3" else 2,
                                   offsets) / (DRAM_GBPS * 1e3)
        us = dp // clusters * tile_us + max(compute_us, dram_us) + reduce_us
        chunks = 0 if q == k_tiles else q
    return Estimate(cfg, swizzle, split, us, tiles, clusters, tiles / clusters, tail, units, note, chunks)


def _split_options(cfg: KernelConfig, m: int, n: int, k: int, sm_count: int, dtype: str = "bf16") -> List[int]:
    """Splits worth modelling: 1, and when the last wave is partial, the splits that make other stream-K plans
    (above one wave every split > 1 is the same plan; below, the pieces per tile up to filling every cluster)."""
    if cfg.max_splits == 1:
        return [1]
    cm, cn = cluster_tiles(cfg, m, n)
    tiles, clusters = cm * cn, persistent_clusters(cfg, sm_count)
    if tiles % clusters == 0:
        return [1]
    if tiles > clusters:
        return [1, 2]
    k_tiles = -(-k // registry.tile_k(dtype))
    top = min(cfg.max_splits, k_tiles, -(-clusters // tiles))
    return list(range(1, top + 1))


def candidates(m: int, n: int, k: int, sm_count: int, *, configs: Optional[Iterable[str]] = None,
               group_rows: Optional[int] = None, elem_bytes: int = 2, dtype: str = "bf16",
               chunks: Optional[int] = 0) -> List[Estimate]:
    """Every (configuration, split) the model considers, fastest first (ties: registry order, fewer splits), each
    with stream-K ranges aligned to `chunks` (0: unaligned, as the kernel's default; None: the model's best
    alignment, `estimate`)."""
    names = list(configs) if configs is not None else list(registry.names())
    if not names:
        raise FluxShmemError("no kernel configuration to choose from (configs is empty)")
    out = []
    for order, name in enumerate(names):
        cfg = registry.get(name)
        for split in _split_options(cfg, m, n, k, sm_count, dtype):
            out.append((order, estimate(cfg, m, n, k, sm_count, split, elem_bytes=elem_bytes,
                                        group_rows=group_rows, dtype=dtype, chunks=chunks)))
    out.sort(key=lambda t: (t[1].us, t[0], t[1].split))
    return [e for _, e in out]


def heuristic(m: int, n: int, k: int, dtype, layout: str, sm_count: int, group_rows: Optional[int] = None, *,
              configs: Optional[Sequence[str]] = None) -> Choice:
    """The model's choice (see the module docstring): the default configuration unless another candidate is
    faster by more than MARGIN."""
    _check(m, n, k, dtype, layout, sm_count)
    dt = dtype_name(dtype)
    return _heuristic(m, n, k, sm_count, group_rows, allowed_configs(configs, dt), dt)


def allowed_configs(configs: Optional[Sequence[str]], dt: str) -> Tuple[str, ...]:
    """`configs` (default: every registry name) less those `dt`'s builds cannot run well: e4m3 under the promoting
    schedule keeps only configurations whose two accumulators fit in registers (registry.names_for)."""
    names = tuple(configs) if configs is not None else registry.names()
    if not names:
        raise FluxShmemError("no kernel configuration to choose from (configs is empty)")
    fit = set(registry.names_for(dt))
    kept = tuple(n for n in names if n in fit)
    if not kept:
        raise FluxShmemError(
            f"none of the configurations {list(names)} runs {dt} without spilling its accumulators under the "
            f"promoting fp8 schedule (those that do: {sorted(fit)}); pass one of those, or set "
            f"{registry.ENV_FP8_FAST_ACCUM}=1 (one accumulator, as torch._scaled_mm(use_fast_accum=True))")
    return kept


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments; ops ask per call
def _heuristic(m: int, n: int, k: int, sm_count: int, group_rows: Optional[int], names: Tuple[str, ...],
               dt: str = "bf16") -> Choice:
    ranked = candidates(m, n, k, sm_count, configs=names, group_rows=group_rows, dtype=dt, chunks=HEURISTIC_CHUNKS)
    default = registry.default_for(dt)
    base_name = default if default in names else names[0]
    base = next(e for e in ranked if e.config.name == base_name and e.split == 1)
    best = ranked[0]
    if best.us * (1 + MARGIN) >= base.us:
        best, why = base, "default; no candidate modelled more than {:.0%} faster".format(MARGIN)
    else:
        why = f"{base.us / best.us:.2f}x faster than the default in the model"
    reason = f"{best.summary()}; {why}" + (f"; {best.swizzle_note}" if best.swizzle_note else "")
    return Choice(best.config.name, best.swizzle, best.split, "heuristic", reason,
                  round(max(best.us, _dram_floor_us(m, n, k, *elem_bytes(dt))) + LAUNCH_US, 1), best.chunks)


def _dram_floor_us(m: int, n: int, k: int, elem_bytes: int = 2, out_bytes: Optional[int] = None) -> float:
    out_bytes = elem_bytes if out_bytes is None else out_bytes
    return ((m * k + k * n) * elem_bytes + m * n * out_bytes) / (DRAM_GBPS * 1e3)


def _check(m: int, n: int, k: int, dtype, layout: str, sm_count: int) -> None:
    dt = dtype_name(dtype)
    if layout not in LAYOUTS:
        raise FluxShmemError(f"layout {layout!r} unknown: 'kn' (B is [K, N]) or 'nk' (B is [N, K])")
    if dt == "e4m3" and layout != "nk":
        raise FluxShmemError(FP8_LAYOUT_ERROR)
    if min(m, n, k) <= 0:
        raise FluxShmemError(f"bad GEMM size {m}x{n}x{k}: M, N and K must be positive")
    if sm_count <= 0:
        raise FluxShmemError(f"sm_count must be > 0, got {sm_count}")


def forced() -> dict:
    """The fields FLUX_SHMEM_GEMM_CONFIG sets: {'config': str, 'swizzle': int, 'split': int, 'chunks': int} (any
    subset; chunks=0: stream-K ranges start at any K-tile)."""
    raw = os.environ.get(ENV_FORCE, "").strip()
    if not raw:
        return {}
    out: dict = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, _, val = part.partition("=") if "=" in part else ("config", "", part)
        key, val = key.strip(), val.strip()
        try:
            if key == "config":
                out["config"] = registry.get(val).name
            elif key == "swizzle":
                if not val.isdigit() or int(val) not in SWIZZLES:
                    raise FluxShmemError(f"swizzle must be one of {SWIZZLES}")
                out["swizzle"] = int(val)
            elif key == "split":
                if not val.isdigit() or not 1 <= int(val) <= registry.MAX_SPLITS:
                    raise FluxShmemError(f"split must be in [1, {registry.MAX_SPLITS}]")
                out["split"] = int(val)
            elif key == "chunks":
                if not val.isdigit():
                    raise FluxShmemError("chunks must be an integer >= 0 (0: ranges start at any K-tile)")
                out["chunks"] = int(val)
            else:
                raise FluxShmemError("keys are config, swizzle, split and chunks")
        except FluxShmemError as e:
            raise FluxShmemError(f"{ENV_FORCE}={raw!r}: bad entry {part!r}: {e}") from None
    return out


def _apply_forced(choice: Choice, force: dict, m: int, group_rows: Optional[int], n: Optional[int] = None) -> Choice:
    if not force:
        return choice
    cfg = registry.get(force.get("config", choice.config))
    swizzle = force.get("swizzle", choice.swizzle if cfg.name == choice.config else swizzle_for(cfg, m, group_rows, n)[0])
    split = min(force.get("split", choice.split if cfg.name == choice.config else 1), cfg.max_splits)
    chunks = force.get("chunks", choice.chunks if (cfg.name, split) == (choice.config, choice.split) else 0)
    text = ",".join(f"{key}={v}" for key, v in force.items())
    return Choice(cfg.name, swizzle, split, "forced", f"{ENV_FORCE}={text}; otherwise {choice.source}",
                  chunks=chunks)


def _fit_group(choice: Choice, m: int, group_rows: Optional[int]) -> Choice:
    """A tuned choice with the swizzle capped to the caller's group_rows."""
    if group_rows is None:
        return choice
    cfg = registry.get(choice.config)
    cap, note = swizzle_for(cfg, m, group_rows)
    if choice.swizzle <= cap:
        return choice
    extra = f"; swizzle {choice.swizzle} capped at {cap} by group_rows={group_rows}" + (f" ({note})" if note else "")
    return dataclasses.replace(choice, swizzle=cap, reason=choice.reason + extra)


def choose(m: int, n: int, k: int, dtype, layout: str, sm_count: int, group_rows: Optional[int] = None, *,
           configs: Optional[Sequence[str]] = None, device=None, use_cache: bool = True,
           tuned: Optional[Mapping[tuple, "object"]] = None, force: Optional[Mapping[str, object]] = None) -> Choice:
    """The configuration, swizzle and split for D[m, n] = A[m, k] @ B on `sm_count` SMs (see the module docstring).

    dtype: 'bf16'/'fp16' or a torch dtype; layout: 'kn' (B [K, N]) or 'nk' (B [N, K]); group_rows: the fused ops'
    cap on the swizzle group, in rows; configs: restrict to these registry names (e.g. the tile_m a fused op was
    built for); device: a tune_cache.DeviceKey (default: the current CUDA device, when there is one) for the
    tuning-cache lookup; use_cache=False: the heuristic alone. `tuned` and `force` replace the cache file and
    FLUX_SHMEM_GEMM_CONFIG with snapshots ({(layout, m, sm_count): tune_cache.Entry} of this n, k and dtype, and
    `forced()`): the fused ops take both from PE 0 at construction, so that every PE chooses alike (their peers
    read tiles by the plan) and no call tunes on one PE only."""
    _check(m, n, k, dtype, layout, sm_count)
    dt = dtype_name(dtype)
    allowed = list(allowed_configs(configs, dt))
    force = forced() if force is None else dict(force)
    choice = None
    if tuned is not None:
        entry = tuned.get((layout, m, sm_count)) if use_cache and "config" not in force else None
        if entry is not None and entry.config in allowed:
            choice = Choice(entry.config, entry.swizzle, entry.split, "tuned",
                            f"measured {entry.ms * 1e3:.0f} us ({entry.candidates} candidates, {entry.measured}; "
                            "PE 0's tuning cache)", round(entry.ms * 1e3, 1), entry.chunks)
    elif use_cache and "config" not in force:
        choice = _tuned(m, n, k, dt, layout, sm_count, allowed, device)
    if choice is not None:
        choice = _fit_group(choice, m, group_rows)
    else:
        choice = heuristic(m, n, k, dt, layout, sm_count, group_rows, configs=allowed)
    return _apply_forced(choice, force, m, group_rows, n)


def _tuned(m: int, n: int, k: int, dt: str, layout: str, sm_count: int, allowed: List[str], device) -> \
        Optional[Choice]:
    from . import tune_cache
    if device is None:
        device = tune_cache.current_device(sm_count)
        if device is None:  # no GPU here: nothing was measured for it
            return None
    else:
        device = dataclasses.replace(device, sm_count=sm_count)
    try:
        entry = tune_cache.shared().lookup(device, registry.tuning_dtype(dt), layout, m, n, k)
    except tune_cache.TuneCacheError as e:
        tune_cache.warn_once(str(e))
        return None
    if entry is None or entry.config not in allowed:
        return None
    return Choice(entry.config, entry.swizzle, entry.split, "tuned",
                  f"measured {entry.ms * 1e3:.0f} us on {device.gpu} ({entry.candidates} candidates, "
                  f"{entry.measured})", round(entry.ms * 1e3, 1), entry.chunks)
