"""What AllGatherGEMM and GEMMReduceScatter share: argument checks, their CUTLASS kernels, the SM budget and its
split between GEMM and communication, tile orders, and the per-M call plans: decided per bucket of M by the fast
model of `plan_fast` (a few ms for a new M), kept in a bounded cache per op."""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Optional

import torch

from ..errors import FluxShmemError
from ..kernels import config as kconfig
from ..kernels import gemm as kgemm
from ..kernels import registry, tune_cache
from ..runtime import pacing, partition, symmetric
from ..runtime.state import get_runtime
from ..runtime.sm_budget import sm_budget
from . import plan_fast, simulate
from ._validate import SUPPORTED_DTYPES, check_dtype, check_tensor, not_capturing, positive

MODES = ("auto", "fused", "decomposed")
# One Hopper SM's dense bf16/fp16 rate as our GEMM reaches it (about 690 TFLOP/s on 132 H200 SMs): only the ratio
# of GEMM to communication time matters to the choices made with it.
TFLOPS_PER_SM = 5.2
# A tile's fixed cost beside its MMA time (epilogue stores, the scheduler's step): gemm_only on 24 and 30 SMs of an
# H100 (2026-12-05) ran 2.0-2.2 us per tile over the rate above at K = 1024 and 3584 alike.
TILE_FIXED_US = 2.0


def b_layout_of(b: torch.Tensor) -> str:
    """'kn' for a row-major [K, N] b, 'nk' for the transpose of a row-major [N, K] weight (b = w.t())."""
    if b.is_contiguous():
        return "kn"
    if b.t().is_contiguous():
        return "nk"
    raise ValueError("b must be row-major [K, N] or the transpose of a row-major [N, K] tensor (w.t()): pass "
                     "b.contiguous()")


@dataclasses.dataclass
class CallPlan:
    """How a call with M = m runs, chosen once per m (the same on every PE: a pure function of shared inputs)."""

    path: str                       # 'fused', 'decomposed' or 'gemm' (one PE)
    engine: str                     # 'sm' (a comm kernel) or 'ce' (copy engines) on the fused path
    comm_blocks: int                # thread blocks of the communication kernel
    gemm_sms: int                   # persistent GEMM CTAs of the path taken
    swizzle: int                    # scheduler swizzle of the path taken
    order: Optional[torch.Tensor]   # M-tile order table of the fused path (plan_call: a list)
    predicted: Optional[simulate.Result]
    reason: str
    tail: int = 0                   # GEMM+RS: (M-tile, column group) pieces reduced after the GEMM, on
    tail_blocks: int = 0            # tail_blocks blocks
    group_tiles: int = 0            # GEMM+RS: reduce units' width in N-tiles (0: whole rows)
    gemm: Optional[kconfig.Choice] = None  # the GEMM kernel configuration and K split of the path taken

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
        return (f"{self.path} (engine={self.engine}, comm_blocks={self.comm_blocks}, gemm_sms={self.gemm_sms}, "
                f"swizzle={self.swizzle}{tail}{gemm}"
                f"{model}; {self.reason})")


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
    links: simulate.Links
    comm_blocks: Optional[int]      # given by the caller (None: the planner's choice)
    fused_configs: tuple[str, ...]  # configurations the fused GEMM may use
    plain_configs: Optional[tuple[str, ...]]  # ... the unfused one (None: all)
    tuned: tuple = ()               # PE 0's tuning-cache entries of this (n, k, dtype): ((layout, m, SMs), Entry)
    forced: tuple = ()              # PE 0's FLUX_SHMEM_GEMM_CONFIG fields
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


@functools.lru_cache(maxsize=4096)
def _choice(inp: PlanInputs, m: int, layout: str, sm_count: int, fused: bool) -> kconfig.Choice:
    c = kconfig.choose(m, inp.n, inp.k, inp.dtype, layout, sm_count,
                       configs=inp.fused_configs if fused else inp.plain_configs, tuned=dict(inp.tuned),
                       force=dict(inp.forced))
    if fused and c.split > 1:
        c = dataclasses.replace(c, split=1, reason=c.reason + "; fused: whole tiles")
    return c


def gemm_model(k: int, config: str = registry.DEFAULT, dtype: str = "bf16") -> simulate.Gemm:
    cfg = registry.get(config)
    rate = TFLOPS_PER_SM * (kconfig.FP8_SPEEDUP if dtype == "e4m3" else 1.0)  # (nominal, until measured)
    return simulate.Gemm.from_rate(k, rate, cfg.tile_m, cfg.tile_n, cfg.cluster_m, TILE_FIXED_US, swizzle_cost=True)


@functools.lru_cache(maxsize=64)
def plan_split(inp: PlanInputs, m: int, config: str) -> tuple[simulate.Split, simulate.Result]:
    """The simulator's choice of engine and SM split for a fused call with M = m, from nothing but the agreed
    inputs (AllGatherGEMM: on PE 0's view of the arrivals and its GEMM; GEMMReduceScatter: every PE's)."""
    g = gemm_model(inp.k, config, inp.dtype)
    if inp.family == "ag_gemm":
        return simulate.plan_ag_gemm(
            world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
            budget_sms=inp.budget_sms, chunk_rows=inp.chunk_rows, links=inp.links, engines=inp.engines,
            comm_blocks=inp.comm_blocks, decomposed_comm_blocks=inp.decomposed_comm_blocks, pes=[0])
    return simulate.plan_gemm_rs(
        world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
        budget_sms=inp.budget_sms, unit_rows=inp.unit_rows, links=inp.links, comm_blocks=inp.comm_blocks,
        decomposed_comm_blocks=inp.decomposed_comm_blocks, group_tiles=inp.group_tiles,
        swizzle=dict(inp.forced).get("swizzle"))  # FLUX_SHMEM_GEMM_CONFIG's swizzle binds the fused GEMM too


def one_pe_plan(inp: PlanInputs, plain: kconfig.Choice) -> CallPlan:
    """One PE: the plain GEMM, nothing to communicate."""
    return CallPlan("gemm", "sm", 0, inp.sms, plain.swizzle, None, None, "one PE: nothing to communicate",
                    gemm=plain)


def no_split_plan(inp: PlanInputs, plain: kconfig.Choice) -> CallPlan:
    """No fused split fits the SM budget: the decomposed path, or mode 'fused''s error naming the fix."""
    if inp.mode == "fused":
        raise ValueError(f"the fused path needs comm_blocks + {inp.cluster_m} SMs beside each other; this "
                         f"context may use {inp.budget_sms}: raise the MPS share or lower comm_blocks") from None
    return CallPlan("decomposed", "sm", inp.comm_blocks or 1, inp.sms, plain.swizzle, None, None,
                    f"the SM budget ({inp.budget_sms}) leaves no room for a GEMM beside the comm kernel", gemm=plain)


def plan_call_full(inp: PlanInputs, m: int, layout: str, rank: int) -> CallPlan:
    """`plan_call` with the simulator itself deciding for this very M (`plan_split`: 0.05 s to seconds per M): the
    reference the fast plans are tested against (tests/test_plan_fast.py), and what benchmarks may compare."""
    plain = inp.choice(m, layout, inp.sms, False)
    if inp.world == 1:
        return one_pe_plan(inp, plain)
    fused = inp.choice(m, layout, inp.sms, True)
    try:
        sp, r = plan_split(inp, m, fused.config)
    except simulate.NoSplit:
        return no_split_plan(inp, plain)
    if inp.mode != "auto":
        path, why = inp.mode, f"mode={inp.mode}"
    else:
        path = "fused" if r.fused_us < r.decomposed_us else "decomposed"
        why = "auto: the simulator's prediction"
    if path == "fused":
        order = simulate.ag_order(r, rank, m, registry.get(fused.config).tile_m, inp.world, inp.chunk_rows) \
            if inp.family == "ag_gemm" else r.detail["order"][rank]
        return CallPlan(path, sp.engine, sp.comm_blocks, sp.gemm_sms, sp.swizzle, list(order), r, why, sp.tail,
                        sp.tail_blocks, sp.group_tiles, gemm=fused)
    return CallPlan(path, "sm", sp.comm_blocks, inp.sms, plain.swizzle, None, r, why, gemm=plain)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The decisions of every call whose M falls in `bucket` (`plan_fast.bucket_of`), made at bucket.rep."""

    bucket: plan_fast.Bucket
    path: str
    split: simulate.Split           # its tail: the tail kind's pieces at bucket.rep
    tail_kind: int                  # plan_fast.TAIL_KINDS
    predicted: simulate.Result
    reason: str
    shortlist: tuple = ()           # GEMM+RS: the best (comm blocks, swizzle, width), for plan_fast.rs_refine


PLAN_BUCKETS = 1024  # bucket decisions kept per process (every op with the same inputs shares them)


@functools.lru_cache(maxsize=PLAN_BUCKETS)
def bucket_plan(inp: PlanInputs, bucket: plan_fast.Bucket, config: str) -> BucketPlan:
    """The fast model's decisions for the fused GEMM configuration `config` at M = bucket.rep (raises
    simulate.NoSplit when no split fits the SM budget)."""
    g, m = gemm_model(inp.k, config, inp.dtype), bucket.rep
    if inp.family == "ag_gemm":
        sp, r = plan_fast.plan_ag_gemm(
            world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
            budget_sms=inp.budget_sms, chunk_rows=inp.chunk_rows, links=inp.links, engines=inp.engines,
            comm_blocks=inp.comm_blocks, decomposed_comm_blocks=inp.decomposed_comm_blocks)
        kind, short = 0, ()
    else:
        rp = plan_fast.plan_gemm_rs(
            world=inp.world, node_size=inp.node_size, m=m, n=inp.n, k=inp.k, elem_bytes=inp.elem_bytes, gemm=g,
            budget_sms=inp.budget_sms, unit_rows=inp.unit_rows, links=inp.links, comm_blocks=inp.comm_blocks,
            decomposed_comm_blocks=inp.decomposed_comm_blocks, group_tiles=inp.group_tiles,
            swizzle=dict(inp.forced).get("swizzle"))
        sp, r, kind, short = rp.split, rp.predicted, rp.tail_kind, rp.shortlist
    where = f"the model's prediction at M = {m} (bucket {bucket.lo}..{bucket.hi})"
    if inp.mode != "auto":
        return BucketPlan(bucket, inp.mode, sp, kind, r, f"mode={inp.mode}; {where}", short)
    path = "fused" if r.fused_us < r.decomposed_us else "decomposed"
    return BucketPlan(bucket, path, sp, kind, r, f"auto: {where}", short)


def bucket_for(inp: PlanInputs, m: int, config: str) -> plan_fast.Bucket:
    """M's bucket for the fused GEMM configuration `config`."""
    cfg = registry.get(config)
    return plan_fast.bucket_of(m, inp.world, cfg.tile_m,
                               plan_fast.linear_limit(cfg.tile_m, cfg.tile_n, cfg.cluster_m, inp.n, inp.sms))


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
        return one_pe_plan(inp, plain)
    fused = inp.choice(m, layout, inp.sms, True)
    try:
        bp = bucket_plan(inp, bucket_for(inp, m, fused.config), fused.config)
    except simulate.NoSplit:
        return no_split_plan(inp, plain)
    sp, r = bp.split, bp.predicted
    if bp.path != "fused":
        return CallPlan(bp.path, "sm", sp.comm_blocks, inp.sms, plain.swizzle, None, r, bp.reason, gemm=plain)
    cfg = registry.get(fused.config)
    if inp.family == "ag_gemm":
        swizzle = kconfig.swizzle_for(cfg, m, inp.chunk_rows, inp.n)[0]
        order = plan_fast.ag_call_order(inp.world, inp.node_size, m, inp.k, inp.elem_bytes, cfg.tile_m,
                                        inp.chunk_rows, inp.links, sp.engine, sp.comm_blocks, rank)
        return CallPlan("fused", sp.engine, sp.comm_blocks, sp.gemm_sms, swizzle, order, r, bp.reason, gemm=fused)
    sp = rs_split(inp, m, bp, fused.config)
    order = plan_fast.rs_tile_order(rank, inp.world, inp.node_size, m, cfg.tile_m)
    same = (sp.comm_blocks, sp.swizzle, sp.group_tiles) == (bp.split.comm_blocks, bp.split.swizzle,
                                                            bp.split.group_tiles)
    why = bp.reason if same else bp.reason + f"; this M's best of the bucket's {len(bp.shortlist)}"
    return CallPlan("fused", sp.engine, sp.comm_blocks, sp.gemm_sms, sp.swizzle, order, r, why, sp.tail,
                    sp.tail_blocks, sp.group_tiles, gemm=fused)


def rs_split(inp: PlanInputs, m: int, bp: BucketPlan, config: str) -> simulate.Split:
    """GEMMReduceScatter's split for this M. In a bucket of one tile count, the bucket's (its GEMM's waves are
    M's), its tail's pieces counted at M; in a geometric bucket, the bucket's shortlist re-estimated at M with
    every tail kind (the last wave, which decides the tail and the reduce units' shape, moves with M there)."""
    sp, cfg = bp.split, registry.get(config)
    if bp.bucket.by_tiles or m == bp.bucket.rep:
        tail = plan_fast.rs_tail(bp.tail_kind, -(-m // cfg.tile_m), -(-inp.n // cfg.tile_n), cfg.cluster_m,
                                 sp.swizzle, sp.group_tiles, sp.gemm_sms // cfg.cluster_m)
        return dataclasses.replace(sp, tail=tail, tail_blocks=sp.tail_blocks if tail else 0)
    return plan_fast.rs_refine(world=inp.world, node_size=inp.node_size, m=m, n=inp.n, elem_bytes=inp.elem_bytes,
                               gemm=gemm_model(inp.k, config, inp.dtype), budget_sms=inp.budget_sms,
                               unit_rows=inp.unit_rows, links=inp.links, shortlist=bp.shortlist)[0]


class PlanCache:
    """An op's call plans by (M, layout): the `capacity` most recently used, and every pinned plan (made by
    `prepare` or used inside a CUDA-graph capture: a captured graph reads its tile order's device memory) on top.
    A mapping for the ops and the GPU checks: get, [key], [key] = plan (a pinned key stays pinned), clear (pins
    too), in, len."""

    def __init__(self, capacity: int):
        self.capacity = positive("plan cache capacity", capacity)
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._pinned: dict = {}

    def get(self, key, default=None):
        if key in self._pinned:
            return self._pinned[key]
        plan = self._lru.get(key)
        if plan is None:
            return default
        self._lru.move_to_end(key)
        return plan

    def __getitem__(self, key):
        plan = self.get(key)
        if plan is None:
            raise KeyError(key)
        return plan

    def __setitem__(self, key, plan) -> None:
        if key in self._pinned:
            self._pinned[key] = plan
            return
        self._lru[key] = plan
        self._lru.move_to_end(key)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def pin(self, key) -> None:
        """Keep the plan of `key` (which must be cached) for the op's life."""
        if key not in self._pinned:
            self._pinned[key] = self._lru.pop(key)

    def pinned(self, key) -> bool:
        return key in self._pinned

    def clear(self) -> None:
        self._lru.clear()
        self._pinned.clear()

    def __contains__(self, key) -> bool:
        return key in self._pinned or key in self._lru

    def __len__(self) -> int:
        return len(self._pinned) + len(self._lru)


def capturing() -> bool:
    """Whether the current stream captures a CUDA graph (False where torch has no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


PLAN_CACHE_ENV = "FLUX_SHMEM_PLAN_CACHE"


def plan_cache_capacity() -> int:
    """Call plans an op keeps besides its pinned ones ($FLUX_SHMEM_PLAN_CACHE, default 256)."""
    v = os.environ.get(PLAN_CACHE_ENV, "256").strip()
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{PLAN_CACHE_ENV} must be a positive integer (plans kept per op), got {v!r}")
    return n


def start_event_enabled() -> bool:
    """Whether fused calls hold their second kernel until every block of the first runs ($FLUX_SHMEM_START_EVENT,
    default 1)."""
    v = os.environ.get("FLUX_SHMEM_START_EVENT", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"FLUX_SHMEM_START_EVENT must be 0 or 1, got {v!r}")
    return v == "1"


class FusedGEMM:
    """Base of the fused ops: validated dimensions, one CUTLASS kernel per B layout, the SM budget of this context
    (MPS share, green context) split between the GEMM and the communication kernel, and per-M call plans."""

    family = ""
    DTYPES: tuple = SUPPORTED_DTYPES  # operand dtypes the op takes

    def __init__(self, max_m: int, n: int, k: int, dtype: torch.dtype, mode: str, comm_blocks: Optional[int]):
        name = type(self).__name__
        check_dtype(name, dtype, self.DTYPES)  # before the runtime: the caller's error on any machine
        # fp8 (e4m3) operands multiply into bf16 (the kernels' D, what GEMM+RS reduces and returns).
        self.fp8 = dtype == torch.float8_e4m3fn
        self.out_dtype = torch.bfloat16 if self.fp8 else dtype
        self.layouts = ("nk",) if self.fp8 else kgemm.B_LAYOUTS  # sm90 fp8 wgmma reads K-major B only
        self.max_m, self.n, self.k = positive("max_m", max_m), positive("n", n), positive("k", k)
        kalign = 16 if self.fp8 else 8
        for what, v, align in (("K", k, kalign), ("N", n, 8)):  # TMA needs 16-byte aligned rows
            if v % align:
                raise ValueError(f"{name}: {what} = {v} is not a multiple of {align} (TMA needs 16-byte rows of "
                                 f"{dtype}); pad {what} to a multiple of {align}")
        rt = self.rt = get_runtime()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_m % rt.world_size:
            raise ValueError(f"max_m = {max_m} must be a multiple of the world size {rt.world_size}")
        self.dtype, self.mode = dtype, mode
        self.comm_blocks = positive("comm_blocks", comm_blocks) if comm_blocks is not None else None
        # The tile height is fixed per op: chunk and unit sizes, M-tile orders and the reduce-scatter's per-M-tile
        # counters are made for it. Which configuration of that height runs a call (tile width, schedule) is the
        # chooser's (kernels/config.py: heuristic, tuning cache, FLUX_SHMEM_GEMM_CONFIG), per M and layout.
        # (fp8: only configurations whose accumulators fit in registers, registry.names_for.)
        runnable = registry.names_for(kconfig.dtype_name(dtype))
        base = registry.get(registry.default_for(kconfig.dtype_name(dtype)))
        self.tile_m, self.cluster_m = base.tile_m, base.cluster_m
        # Cooperative only: the pingpong kernels' waiting mainloop / signalling epilogue have not been through the
        # fused checks yet (their plain GEMMs have).
        self.configs = tuple(c for c in runnable
                             if (registry.get(c).tile_m, registry.get(c).cluster_m) == (self.tile_m, self.cluster_m)
                             and not registry.get(c).pingpong)
        # Every kernel a call may launch is loaded now, while no kernel of this op spins: a first launch that
        # loads lazily can wait for the running kernels (kernels/module.py load_into_context). Build or load
        # errors surface here too.
        for c in runnable:
            for layout in self.layouts:
                kgemm.CutlassGemm.get(self.family, dtype, layout, c)
        self.budget = sm_budget(rt.device)
        self.sms = self.budget.sms // self.cluster_m * self.cluster_m  # persistent grids never exceed the budget
        if self.sms < self.cluster_m:
            raise ValueError(f"{name}: this context may use {self.budget.sms} SM(s) ({self.budget.source}), fewer "
                             f"than one {self.cluster_m}-CTA cluster: raise CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        # The comm stream has the highest priority, so that its blocks are scheduled ahead of the GEMM's when
        # both wait for SMs; the split below keeps both inside the budget.
        self.comm_stream = partition.side_stream(rt.device, priority=min(torch.cuda.Stream.priority_range()))
        # Whichever kernel of a fused call waits on the other's signals must never hold SMs while the other still
        # waits for some: it is launched only once every block of the other kernel runs (AllGatherGEMM: its start
        # gate; GEMMReduceScatter: a launch-completion event). Seen 2026-12-03 without a guard: 4 PEs under MPS,
        # a PE's gather kernel not running while its GEMM and the peers' spun. FLUX_SHMEM_START_EVENT=0 drops
        # the guards (the second kernel follows right away, on priority alone).
        self.guarded = start_event_enabled()
        self.emulation = pacing.emulation()
        self.links = simulate.Links() if self.emulation is None else simulate.emulated_links(
            self.emulation.gbps, self.emulation.latency_us, self.emulation.ib_gbps, self.emulation.ib_latency_us)
        # Puts to PEs whose memory is mapped here (forced puts, node groups of one host) are copies by the
        # issuing block (seen 2026-12-04: forced puts, 2 PEs, the plan's 1 gather block moved 15 GB/s).
        self.links = dataclasses.replace(self.links, put_by_blocks=all(rt.reachable))

        self._plans = PlanCache(plan_cache_capacity())
        # The chooser's inputs that live outside the arguments (tuning cache, FLUX_SHMEM_GEMM_CONFIG) are PE 0's,
        # read once: every PE then chooses the same GEMM configuration for every M.
        dt = kconfig.dtype_name(dtype)
        self._tuned, self._forced = rt.host.allgather((tuple(sorted(tune_cache.snapshot(registry.tuning_dtype(dt), n, k).items())),
                                                       tuple(sorted(kconfig.forced().items()))))[0]
        self.inputs = self.plan_inputs()

    # ---------------------------------------------------------------------------------------------------------
    def plan_inputs(self, **family) -> PlanInputs:
        """This op's planner inputs (`family`: the op's own fields of PlanInputs)."""
        return PlanInputs(family=self.family, world=self.rt.world_size, node_size=self.rt.node_size, n=self.n,
                          k=self.k, dtype=kconfig.dtype_name(self.dtype),
                          elem_bytes=torch.empty((), dtype=self.wire_dtype).element_size(), mode=self.mode,
                          budget_sms=self.budget.sms, sms=self.sms, cluster_m=self.cluster_m, links=self.links,
                          comm_blocks=self.comm_blocks, fused_configs=self.configs,
                          plain_configs=self.plain_configs(), tuned=self._tuned, forced=self._forced, **family)

    def agree_inputs(self, **family) -> None:
        """Fix this op's planner inputs and check that every PE has the same (collective): SM budgets, link models
        (emulation, forced puts, reachability), world and node size, GEMM choices' sources."""
        self.inputs = self.plan_inputs(**family)
        symmetric.agree(f"{type(self).__name__}'s planner inputs (SM budget, links, GEMM configurations; give every "
                        "PE the same MPS share or green-context size, FLUX_SHMEM_LINK_* and FLUX_SHMEM_FORCE_PUT)",
                        self.inputs)

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of what the op's communication moves (the planner's bytes)."""
        return self.dtype

    def kernel(self, layout: str, config: str) -> kgemm.CutlassGemm:
        return kgemm.CutlassGemm.get(self.family, self.dtype, layout, config)

    def plain_configs(self) -> Optional[tuple[str, ...]]:
        """Configurations the unfused GEMM may use (None: all)."""
        return None

    def gemm_choice(self, m: int, layout: str, sm_count: int, *, fused: bool = False) -> kconfig.Choice:
        """The configuration for this op's GEMM with M = m on `sm_count` SMs (PlanInputs.choice)."""
        return self.inputs.choice(m, layout, sm_count, fused)

    def call_plan(self, m: int, layout: str = "nk", *, pin: bool = False) -> CallPlan:
        """How a call with M = m and B layout `layout` runs (`plan_call`, cached per (m, layout)). pin: keep the plan
        for the op's life (`prepare`; so is a plan used inside a CUDA-graph capture, which reads its tile order)."""
        key = (m, layout)
        plan = self._plans.get(key)
        if plan is not None:
            if not self._plans.pinned(key) and (pin or capturing()):
                self._plans.pin(key)
        else:
            not_capturing(f"{type(self).__name__} with M = {m}")
            try:
                plan = plan_call(self.inputs, m, layout, self.rt.rank)
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}: {e} ({self.budget.source})") from None
            if plan.order is not None:
                plan = dataclasses.replace(plan, order=self._upload(plan.order))
            self._plans[key] = plan
            if pin:
                self._plans.pin(key)
        return plan

    def _upload(self, order: list[int]) -> torch.Tensor:
        """A tile order table as the kernels read it (int32 on this PE's device)."""
        return torch.tensor(order, dtype=torch.int32, device=f"cuda:{self.rt.device}")

    def prepare(self, ms, layouts=("nk",)) -> None:
        """Plan calls with every M of `ms` and B layouts `layouts` now: the planner's host time leaves the calls,
        and a CUDA graph captured afterwards finds its plans made (a capture cannot plan). These plans are pinned:
        the op's bounded plan cache never evicts them. Nothing collective: plans depend only on the inputs every
        PE agreed on."""
        for layout in layouts:
            if layout not in self.layouts:
                raise ValueError(f"layout must be one of {self.layouts}, got {layout!r}")
            for m in ms:
                m = positive("m", int(m))
                if m > self.max_m or m % self.rt.world_size:
                    raise ValueError(f"{type(self).__name__}.prepare: M = {m} is not a multiple of the world size "
                                     f"{self.rt.world_size} up to max_m = {self.max_m}")
                self.call_plan(m, layout, pin=True)

    def path(self, m: int, layout: str = "nk") -> str:
        """'fused' or 'decomposed' (or 'gemm' with one PE, where there is nothing to communicate): what a call
        with M = m runs."""
        return self.call_plan(m, layout).path

    def check_operands(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, what: str) -> str:
        """Validate a [*, k], b [k, n] (either layout) and bias [n]; returns b's layout."""
        rt, k, n = self.rt, self.k, self.n
        check_tensor("a", a, dtype=self.dtype, device=rt.device)
        if not isinstance(b, torch.Tensor) or b.dim() != 2:
            raise ValueError(f"b must be a 2-D tensor [K, N], got {getattr(b, 'shape', type(b).__name__)}")
        if b.dtype != self.dtype or b.device != a.device:
            raise TypeError(f"b has {b.dtype} on {b.device}; {what} needs {self.dtype} on {a.device}")
        if tuple(b.shape) != (k, n):
            raise ValueError(f"b has shape {tuple(b.shape)}; {what} was built for [K, N] = [{k}, {n}]")
        if a.shape[1] != k:
            raise ValueError(f"a has {a.shape[1]} columns; {what} was built for K = {k}")
        if b.data_ptr() % 16:
            raise ValueError("b must start on a 16-byte boundary: pass a fresh tensor or b.clone()")
        if bias is not None:
            check_tensor("bias", bias, dtype=self.out_dtype, device=rt.device, ndim=1)
            if bias.shape[0] != n:
                raise ValueError(f"bias has {bias.shape[0]} entries, expected N = {n}")
        layout = b_layout_of(b)
        if layout not in self.layouts:
            raise ValueError(f"{what}: {kconfig.FP8_LAYOUT_ERROR}")
        return layout

    def check_scales(self, a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, what: str) -> tuple[int, int, int]:
        """(scale_a address, scale_b address, scale kind) for the kernels: fp8 ops need both fp32 scales
        (torch._scaled_mm's layouts: per-tensor, or one per row of a / column of b), 16-bit ops none."""
        if not self.fp8:
            if scale_a is not None or scale_b is not None:
                raise ValueError(f"{what}: scale_a/scale_b are for float8_e4m3fn operands; this op was built for "
                                 f"{self.dtype}: drop them, or build the op with dtype=torch.float8_e4m3fn")
            return 0, 0, 0
        try:
            sa, sb, kind = kgemm.fp8_scales(a, b, scale_a, scale_b)
        except FluxShmemError as e:  # it names the fix; say which op
            raise ValueError(f"{what}: {e}") from None
        return sa.data_ptr(), sb.data_ptr(), kind
