"""What a fused op's call plans depend on (`PlanInputs`, agreed by every PE when the op is built), the GEMM
configuration chosen for a call shape from them (`PlanInputs.choice`), and the planners' GEMM model (`gemm_model`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from ..kernels import backends
from ..kernels import config as kconfig
from ..kernels import registry
from .costs import Gemm, Links

MODES = ("auto", "fused", "decomposed")
# One Hopper SM's dense bf16/fp16 rate as our GEMM reaches it (about 690 TFLOP/s on 132 H200 SMs): only the ratio
# of GEMM to communication time matters to the choices made with it.
TFLOPS_PER_SM = 5.2
# A tile's fixed cost beside its MMA time (epilogue stores, the scheduler's step): gemm_only on 24 and 30 SMs of an
# H100 (2026-12-05) ran 2.0-2.2 us per tile over the rate above at K = 1024 and 3584 alike.
TILE_FIXED_US = 2.0


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """Everything a fused op's call plans depend on, agreed by every PE at construction (`symmetric.agree`): the
    plans are a pure function of these, M and the B layout (`plan_call`), so every PE plans alike and a PE built
    with other inputs raises there instead of hanging its peers in a call. The PE's rank only picks its own M-tile
    order table out of the plan."""

    family: str                     # 'ag_gemm' or 'gemm_rs'
    world: int
    node_size: int
    n: int
    k: int
    dtype: str                      # operands: 'bf16' / 'fp16' / 'e4m3'
    elem_bytes: int                 # bytes per element of what travels (GEMM+RS: the partials, 16-bit)
    mode: str
    budget_sms: int                 # this context's SM budget (MPS share, green context)
    sms: int                        # persistent grid of the unfused GEMM (the budget in whole clusters)
    cluster_m: int
    links: Links
    comm_blocks: Optional[int]      # given by the caller (None: the planner's choice)
    fused_configs: tuple[str, ...]  # configurations the fused GEMM may use
    plain_configs: Optional[tuple[str, ...]]  # ... the unfused one (None: all)
    tuned: tuple = ()               # PE 0's tuning-cache entries of this (n, k, dtype): ((layout, m, SMs), Entry)
    forced: tuple = ()              # PE 0's FLUX_SHMEM_GEMM_CONFIG fields
    records: tuple = ()             # PE 0's plain-GEMM records of this (family, dtype, n, k): backends.snapshot
    plain_gemm: str = "auto"        # PE 0's FLUX_SHMEM_PLAIN_GEMM ('auto': the records decide ours or cuBLAS)
    # AllGatherGEMM
    engines: tuple[str, ...] = ("sm",)
    chunk_rows: int = 0
    # GEMMReduceScatter
    unit_rows: int = 0
    group_tiles: Optional[int] = None
    decomposed_comm_blocks: int = 0

    def choice(self, m: int, layout: str, sm_count: int, fused: bool) -> kconfig.Choice:
        """The GEMM configuration for M = m on `sm_count` SMs. The fused GEMM keeps the op's tile height and whole
        tiles (split 1): its overlap plan (arrival order, counters per M-tile, tail) is made for those."""
        return _choice(self, m, layout, sm_count, fused)

    def backend(self, m: int, layout: str) -> backends.Backend:
        """What runs the unfused GEMM of a call with M = m (decomposed path, one PE): our kernel or cuBLAS, from
        the records (kernels/backends.py) at this op's SM count."""
        return _backend(self, m, layout)


@functools.lru_cache(maxsize=4096)
def _choice(inp: PlanInputs, m: int, layout: str, sm_count: int, fused: bool) -> kconfig.Choice:
    c = kconfig.choose(m, inp.n, inp.k, inp.dtype, layout, sm_count,
                       configs=inp.fused_configs if fused else inp.plain_configs, tuned=dict(inp.tuned),
                       force=dict(inp.forced))
    if fused and c.split > 1:
        c = dataclasses.replace(c, split=1, reason=c.reason + "; fused: whole tiles")
    return c


@functools.lru_cache(maxsize=4096)
def _backend(inp: PlanInputs, m: int, layout: str) -> backends.Backend:
    if inp.dtype == "e4m3" and (inp.n % 16 or inp.k % 16):
        return backends.Backend(backends.OURS, f"torch._scaled_mm needs N and K multiples of 16 (N = {inp.n}, K = "
                                               f"{inp.k}); ours takes N multiples of 8")
    return backends.choose(inp.records, m, layout, inp.sms, what=f"{inp.family} {inp.dtype} Mx{inp.n}x{inp.k}",
                           force=inp.plain_gemm)


def gemm_model(k: int, config: str = registry.DEFAULT, dtype: str = "bf16",
               n: Optional[int] = None) -> Gemm:
    """The planners' GEMM of K = k (and output width n: the plain GEMM's swizzle there, for the fused swizzle's
    cost; None: the widest)."""
    cfg = registry.get(config)
    rate = TFLOPS_PER_SM * (kconfig.FP8_SPEEDUP if dtype == "e4m3" else 1.0)  # (nominal, until measured)
    return Gemm.from_rate(k, rate, cfg.tile_m, cfg.tile_n, cfg.cluster_m, TILE_FIXED_US, swizzle_cost=True,
                          plain_swizzle=kconfig.swizzle_cap_for_n(n))
