"""Per-M call plans of the fused ops: `plan_call` (the fast model's decisions per bucket of M, what a call runs)
and `plan_call_full` (the simulator itself, for comparison). Each is a pure function of the agreed `PlanInputs`,
M and the B layout: every PE plans alike; the rank only picks the PE's own M-tile order."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from ..kernels import backends
from ..kernels import config as kconfig
from ..kernels import registry
from . import fast, fast_ag, fast_rs, search
from .inputs import PlanInputs, _choice, gemm_model
from .simulate import Result

# Mode 'auto' against what the model does not see. A call's host work bounds it from below: measured on an H100
# (2026-12-07, 2 and 4 PEs under MPS, 6 shard shapes, M = 64, device_steps.sh autosweep2/4) a fused call took
# 150-360 us however small its GEMM (median ~250: two streams, the start gate, the gather or reduce kernel, the
# epoch bump), cuBLAS and our collective 94-250 (median ~150). And fusing must win by AUTO_MARGIN: the model's
# fused and decomposed times were off by up to 15-30% in either direction there, and the decomposed path with
# cuBLAS is what a user runs without us.
HOST_US = {"fused": 250.0, "decomposed": 150.0}
AUTO_MARGIN = 0.05


@dataclasses.dataclass
class CallPlan:
    """How a call with M = m runs, chosen once per m (the same on every PE: a pure function of shared inputs)."""

    path: str                       # 'fused', 'decomposed' or 'gemm' (one PE)
    engine: str                     # 'sm' (a comm kernel) or 'ce' (copy engines) on the fused path
    comm_blocks: int                # thread blocks of the communication kernel
    gemm_sms: int                   # persistent GEMM CTAs of the path taken
    swizzle: int                    # scheduler swizzle of the path taken
    order: Optional[object]         # M-tile order table of the fused path (plan_call: a list; the op
    #                                 keeps it as an int32 device tensor)
    predicted: Optional[Result]
    reason: str
    tail: int = 0                   # GEMM+RS: (M-tile, column group) pieces reduced after the GEMM, on
    tail_blocks: int = 0            # tail_blocks blocks
    group_tiles: int = 0            # GEMM+RS: reduce units' width in N-tiles (0: whole rows)
    gemm: Optional[kconfig.Choice] = None  # the GEMM kernel configuration and K split of the path taken
    backend: Optional[backends.Backend] = None  # who runs the unfused GEMM ('gemm', 'decomposed'): ours or cuBLAS

    @property
    def config(self) -> str:
        return self.gemm.config if self.gemm is not None else registry.DEFAULT

    def describe(self) -> str:
        p = self.predicted
        model = "" if p is None else (f", predicted fused {p.fused_us:.0f} us vs decomposed {p.decomposed_us:.0f} "
                                      f"us ({100 * p.hidden:.0f}% of {p.comm_us:.0f} us comm hidden)")
        tail = f", tail {self.tail} pieces on {self.tail_blocks} blocks" if self.tail else ""
        tail += f", reduce units {self.group_tiles} N-tiles wide" if self.group_tiles else ""
        gemm = "" if self.gemm is None else f", gemm {self.gemm.config} split={self.gemm.split} ({self.gemm.source})"
        if self.backend is not None:
            gemm = f", plain GEMM: {self.backend.describe()}" + (gemm if self.backend.name == backends.OURS else "")
        return (f"{self.path} (engine={self.engine}, comm_blocks={self.comm_blocks}, gemm_sms={self.gemm_sms}, "
                f"swizzle={self.swizzle}{tail}{gemm}"
                f"{model}; {self.reason})")


@functools.lru_cache(maxsize=64)
def plan_split(inp: PlanInputs, m: int, config: str) -> tuple[search.Split, Result]:
    """The simulator's choice of engine and SM split for a fused call with M = m, from nothing but the agreed
    inputs (AllGatherGEMM: on PE 0's view of the arrivals and its GEMM; GEMMReduceScatter: every PE's)."""
    g = gemm_model(inp.k, config, inp.dtype, inp.n)
    if inp.family == "ag_gemm":
        return search.plan_ag_gemm(
            world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
            budget_sms=inp.budget_sms, chunk_rows=inp.chunk_rows, links=inp.links, engines=inp.engines,
            comm_blocks=inp.comm_blocks, decomposed_comm_blocks=inp.decomposed_comm_blocks, pes=[0])
    return search.plan_gemm_rs(
        world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
        budget_sms=inp.budget_sms, unit_rows=inp.unit_rows, links=inp.links, comm_blocks=inp.comm_blocks,
        decomposed_comm_blocks=inp.decomposed_comm_blocks, group_tiles=inp.group_tiles,
        swizzle=dict(inp.forced).get("swizzle"))  # FLUX_SHMEM_GEMM_CONFIG's swizzle binds the fused GEMM too


def one_pe_plan(inp: PlanInputs, m: int, layout: str, plain: kconfig.Choice) -> CallPlan:
    """One PE: the plain GEMM (ours or cuBLAS, `PlanInputs.backend`), nothing to communicate."""
    return CallPlan("gemm", "sm", 0, inp.sms, plain.swizzle, None, None, "one PE: nothing to communicate",
                    gemm=plain, backend=inp.backend(m, layout))


def no_split_plan(inp: PlanInputs, m: int, layout: str, plain: kconfig.Choice) -> CallPlan:
    """No fused split fits the SM budget: the decomposed path, or mode 'fused''s error naming the fix."""
    if inp.mode == "fused":
        raise ValueError(f"the fused path needs comm_blocks + {inp.cluster_m} SMs beside each other; this "
                         f"context may use {inp.budget_sms}: raise the MPS share or lower comm_blocks") from None
    return CallPlan("decomposed", "sm", inp.comm_blocks or 1, inp.sms, plain.swizzle, None, None,
                    f"the SM budget ({inp.budget_sms}) leaves no room for a GEMM beside the comm kernel", gemm=plain,
                    backend=inp.backend(m, layout))


def auto_path(r: Result, backend: backends.Backend) -> tuple[str, str]:
    """Mode 'auto''s path from a prediction: fused only where it beats the decomposed path, whose GEMM is
    `backend`'s (cuBLAS: the model's time for ours x the records' ratio), by AUTO_MARGIN, each at least its
    host time (HOST_US)."""
    dec = r.decomposed_us - (r.gemm_all_us * (1 - backend.ratio) if backend.name == backends.CUBLAS else 0.0)
    fused_us, dec_us = max(r.fused_us, HOST_US["fused"]), max(dec, HOST_US["decomposed"])
    path = "fused" if fused_us < dec_us * (1 - AUTO_MARGIN) else "decomposed"
    return path, (f"auto: fused {fused_us:.0f} us vs decomposed {dec_us:.0f} us with {backend.name}'s GEMM "
                  f"(host time at least {HOST_US['fused']:.0f} / {HOST_US['decomposed']:.0f} us; fused must win by "
                  f"{AUTO_MARGIN:.0%})")


def plan_call_full(inp: PlanInputs, m: int, layout: str, rank: int) -> CallPlan:
    """`plan_call` with the simulator itself deciding for this very M (`plan_split`: 0.05 s to seconds per M): the
    reference the fast plans are tested against (tests/test_plan_fast.py), and what benchmarks may compare."""
    plain = inp.choice(m, layout, inp.sms, False)
    if inp.world == 1:
        return one_pe_plan(inp, m, layout, plain)
    fused = inp.choice(m, layout, inp.sms, True)
    try:
        sp, r = plan_split(inp, m, fused.config)
    except search.NoSplit:
        return no_split_plan(inp, m, layout, plain)
    if inp.mode != "auto":
        path, why = inp.mode, f"mode={inp.mode}"
    else:
        path, why = auto_path(r, inp.backend(m, layout))
        why += " (the simulator's prediction)"
    if path == "fused":
        order = search.ag_order(r, rank, m, registry.get(fused.config).tile_m, inp.world, inp.chunk_rows) \
            if inp.family == "ag_gemm" else r.detail["order"][rank]
        return CallPlan(path, sp.engine, sp.comm_blocks, sp.gemm_sms, sp.swizzle, list(order), r, why, sp.tail,
                        sp.tail_blocks, sp.group_tiles, gemm=fused)
    return CallPlan(path, "sm", sp.comm_blocks, inp.sms, plain.swizzle, None, r, why, gemm=plain,
                    backend=inp.backend(m, layout))


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The decisions of every call whose M falls in `bucket` (`fast.bucket_of`), made at bucket.rep."""

    bucket: fast.Bucket
    path: str
    split: search.Split           # its tail: the tail kind's pieces at bucket.rep
    tail_kind: int                  # fast_rs.TAIL_KINDS
    predicted: Result
    reason: str
    shortlist: tuple = ()           # GEMM+RS: the best (comm blocks, swizzle, width), for fast_rs.rs_refine


PLAN_BUCKETS = 1024  # bucket decisions kept per process (every op with the same inputs shares them)


@functools.lru_cache(maxsize=PLAN_BUCKETS)
def bucket_plan(inp: PlanInputs, bucket: fast.Bucket, config: str, layout: str) -> BucketPlan:
    """The fast model's decisions for the fused GEMM configuration `config` at M = bucket.rep, B layout `layout`
    (the decomposed path's GEMM backend depends on it; raises search.NoSplit when no split fits the SM budget)."""
    g, m = gemm_model(inp.k, config, inp.dtype, inp.n), bucket.rep
    if inp.family == "ag_gemm":
        sp, r = fast_ag.plan_ag_gemm(
            world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
            budget_sms=inp.budget_sms, chunk_rows=inp.chunk_rows, links=inp.links, engines=inp.engines,
            comm_blocks=inp.comm_blocks, decomposed_comm_blocks=inp.decomposed_comm_blocks)
        kind, short = 0, ()
    else:
        rp = fast_rs.plan_gemm_rs(
            world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
            budget_sms=inp.budget_sms, unit_rows=inp.unit_rows, links=inp.links, comm_blocks=inp.comm_blocks,
            decomposed_comm_blocks=inp.decomposed_comm_blocks, group_tiles=inp.group_tiles,
            swizzle=dict(inp.forced).get("swizzle"))
        sp, r, kind, short = rp.split, rp.predicted, rp.tail_kind, rp.shortlist
    where = f"the model's prediction at M = {m} (bucket {bucket.lo}..{bucket.hi})"
    if inp.mode != "auto":
        return BucketPlan(bucket, inp.mode, sp, kind, r, f"mode={inp.mode}; {where}", short)
    path, why = auto_path(r, inp.backend(m, layout))
    return BucketPlan(bucket, path, sp, kind, r, f"{why}; {where}", short)


def forget_decisions() -> None:
    """Forget every cached planning decision of this process (the next plan_call decides as for a new bucket): what
    benchmarks/plan_speed.py times and the planner's tests count."""
    for f in (bucket_plan, _choice, plan_split, fast_rs.rs_last_wave, fast_rs.rs_geometry, fast_rs._reduced_geometry):
        f.cache_clear()


def bucket_for(inp: PlanInputs, m: int, config: str) -> fast.Bucket:
    """M's bucket for the fused GEMM configuration `config`."""
    cfg = registry.get(config)
    return fast.bucket_of(m, inp.world, cfg.tile_m,
                          fast.linear_limit(cfg.tile_m, cfg.tile_n, cfg.cluster_m, inp.n, inp.sms))


def plan_call(inp: PlanInputs, m: int, layout: str, rank: int) -> CallPlan:
    """How a call with M = m and B layout `layout` runs on PE `rank`: path, engine, SM split, GEMM configurations,
    swizzle, tail, tile order (a list; the op keeps it as a device tensor). Everything but the order is the same on
    every PE: a pure function of the agreed inputs. The GEMM configurations are chosen for this M; the path and the
    split are decided once per bucket of M (`bucket_plan`: the split the fast model predicts fastest; mode 'auto'
    fuses when that prediction beats the decomposed path); what depends on M itself is made for it: the M-tile
    order, the tail's pieces (of the bucket's tail kind), the all-gather's swizzle, and in a geometric bucket
    GEMMReduceScatter's split among the bucket's shortlist (`rs_split`)."""
    plain = inp.choice(m, layout, inp.sms, False)
    if inp.world == 1:
        return one_pe_plan(inp, m, layout, plain)
    fused = inp.choice(m, layout, inp.sms, True)
    try:
        bp = bucket_plan(inp, bucket_for(inp, m, fused.config), fused.config, layout)
    except search.NoSplit:
        return no_split_plan(inp, m, layout, plain)
    sp, r = bp.split, bp.predicted
    if bp.path != "fused":
        return CallPlan(bp.path, "sm", sp.comm_blocks, inp.sms, plain.swizzle, None, r, bp.reason, gemm=plain,
                        backend=inp.backend(m, layout))
    cfg = registry.get(fused.config)
    if inp.family == "ag_gemm":
        swizzle = kconfig.swizzle_for(cfg, m, inp.chunk_rows, inp.n)[0]
        order = fast_ag.ag_call_order(inp.world, inp.node_size, m, inp.k, inp.elem_bytes, cfg.tile_m,
                                        inp.chunk_rows, inp.links, sp.engine, sp.comm_blocks, rank)
        return CallPlan("fused", sp.engine, sp.comm_blocks, sp.gemm_sms, swizzle, order, r, bp.reason, gemm=fused)
    sp = rs_split(inp, m, bp, fused.config)
    order = fast_rs.rs_tile_order(rank, inp.world, inp.node_size, m, cfg.tile_m)
    same = (sp.comm_blocks, sp.swizzle, sp.group_tiles) == (bp.split.comm_blocks, bp.split.swizzle,
                                                            bp.split.group_tiles)
    why = bp.reason if same else bp.reason + f"; this M's best of the bucket's {len(bp.shortlist)}"
    return CallPlan("fused", sp.engine, sp.comm_blocks, sp.gemm_sms, sp.swizzle, order, r, why, sp.tail,
                    sp.tail_blocks, sp.group_tiles, gemm=fused)


def rs_split(inp: PlanInputs, m: int, bp: BucketPlan, config: str) -> search.Split:
    """GEMMReduceScatter's split for this M. In a bucket of one tile count, the bucket's (its GEMM's waves are
    M's), its tail's pieces counted at M; in a geometric bucket, the bucket's shortlist re-estimated at M with
    every tail kind (the last wave, which decides the tail and the reduce units' shape, moves with M there)."""
    sp, cfg = bp.split, registry.get(config)
    if bp.bucket.by_tiles or m == bp.bucket.rep:
        tail = fast_rs.rs_tail(bp.tail_kind, -(-m // cfg.tile_m), -(-inp.n // cfg.tile_n), cfg.cluster_m,
                                 sp.swizzle, sp.group_tiles, sp.gemm_sms // cfg.cluster_m)
        return dataclasses.replace(sp, tail=tail, tail_blocks=sp.tail_blocks if tail else 0)
    return fast_rs.rs_refine(world=inp.world, node_size=inp.node_size, m=m, n=inp.n, elem_bytes=inp.elem_bytes,
                               gemm=gemm_model(inp.k, config, inp.dtype, inp.n), budget_sms=inp.budget_sms,
                               unit_rows=inp.unit_rows, links=inp.links, shortlist=bp.shortlist)[0]
