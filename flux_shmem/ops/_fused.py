"""What AllGatherGEMM and GEMMReduceScatter share: argument checks, their CUTLASS kernels, the SM budget of this
context, the planner's inputs agreed by every PE, and the per-M call plans (flux_shmem.plan.call: a few ms for a
new M), kept in a bounded cache per op."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from ..errors import FluxShmemError
from ..kernels import backends
from ..kernels import config as kconfig
from ..kernels import gemm as kgemm
from ..kernels import registry, tune_cache
from ..runtime import collective, pacing, partition, stall, symmetric
from ..runtime.state import get_runtime
from ..runtime.sm_budget import sm_budget
from ..plan import costs
from ..plan.cache import PLAN_CACHE_ENV, PlanCache, plan_cache_capacity
from ..plan.call import CallPlan, plan_call
from ..plan.inputs import MODES, PlanInputs
from ._validate import SUPPORTED_DTYPES, capturing, check_dtype, check_tensor, not_capturing, positive


def b_layout_of(b: torch.Tensor) -> str:
    """'kn' for a row-major [K, N] b, 'nk' for the transpose of a row-major [N, K] weight (b = w.t())."""
    if b.is_contiguous():
        return "kn"
    if b.t().is_contiguous():
        return "nk"
    raise ValueError("b must be row-major [K, N] or the transpose of a row-major [N, K] tensor (w.t()): pass "
                     "b.contiguous()")


CHECK_PLANS_ENV = "FLUX_SHMEM_CHECK_PLANS"


def check_plans_enabled() -> bool:
    """$FLUX_SHMEM_CHECK_PLANS=1: every PE compares a digest of each new call plan at its first call."""
    v = os.environ.get(CHECK_PLANS_ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{CHECK_PLANS_ENV} must be 0 or 1, got {v!r}")
    return v == "1"


def plan_digest(plan: CallPlan) -> tuple:
    """What every PE's plan of one call must share (all but the PE's own tile order and the prediction)."""
    b = plan.backend.name if plan.backend is not None else None
    return (plan.path, plan.engine, plan.comm_blocks, plan.gemm_sms, plan.swizzle, plan.tail, plan.tail_blocks,
            plan.group_tiles, plan.gemm, b)


def start_event_enabled() -> bool:
    """Whether fused calls hold their second kernel until every block of the first runs ($FLUX_SHMEM_START_EVENT,
    default 1)."""
    v = os.environ.get("FLUX_SHMEM_START_EVENT", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"FLUX_SHMEM_START_EVENT must be 0 or 1, got {v!r}")
    return v == "1"


class FusedGEMM:
    """Base of the fused ops: validated dimensions, one CUTLASS kernel per B layout, the SM budget of this context
    (MPS share, green context) split between the GEMM and the communication kernel, and per-M call plans.

    `__init__` does only what is local to this PE (checks, environment, kernel loads, the SM budget); a family
    calls it inside `collective.all_or_none`, so an error on one PE reaches every PE, then does the collective
    part (`share_choices`, buffers, `agree_inputs`)."""

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
        # Whichever kernel of a fused call waits on the other's signals must never hold SMs while the other still
        # waits for some: it is launched only once every block of the other kernel runs (AllGatherGEMM: its start
        # gate; GEMMReduceScatter: a launch-completion event). Seen 2026-12-03 without a guard: 4 PEs under MPS,
        # a PE's gather kernel not running while its GEMM and the peers' spun. FLUX_SHMEM_START_EVENT=0 drops
        # the guards (the second kernel follows right away, on priority alone).
        self.guarded = start_event_enabled()
        self.emulation = pacing.emulation()
        self.links = costs.Links() if self.emulation is None else costs.emulated_links(
            self.emulation.gbps, self.emulation.latency_us, self.emulation.ib_gbps, self.emulation.ib_latency_us)
        # Puts to PEs whose memory is mapped here (forced puts, node groups of one host) are copies by the
        # issuing block (seen 2026-12-04: forced puts, 2 PEs, the plan's 1 gather block moved 15 GB/s).
        self.links = dataclasses.replace(self.links, put_by_blocks=all(rt.reachable))

        self._plans = PlanCache(plan_cache_capacity())
        self.check_plans = check_plans_enabled()
        self._checked: set = set()
        # What the chooser and the backend rule read outside the arguments (tuning cache, FLUX_SHMEM_GEMM_CONFIG,
        # the plain-GEMM records, FLUX_SHMEM_PLAIN_GEMM), this PE's view; `share_choices` makes PE 0's everyone's.
        dt = kconfig.dtype_name(dtype)
        self._choices = (tuple(sorted(tune_cache.snapshot(registry.tuning_dtype(dt), n, k).items())),
                         tuple(sorted(kconfig.forced().items())),
                         backends.snapshot(backends.current_gpu(), self.family, registry.tuning_dtype(dt), n, k),
                         backends.forced())
        self._tuned, self._forced, self._records, self._plain_gemm = self._choices
        # Everything above is read from the arguments and the environment: every PE checks it before the GPU work
        # below, so that a bad value on one PE stops all of them here, naming it (the enclosing all_or_none).
        self._exchange(f"{name}'s settings (arguments and FLUX_SHMEM_* variables, checked on every PE)", None)
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

    def share_choices(self) -> None:
        """Collective: take PE 0's tuning-cache entries, FLUX_SHMEM_GEMM_CONFIG, GEMM records and
        FLUX_SHMEM_PLAIN_GEMM, read once, so that every PE chooses alike for every M (peers read tiles by the plan),
        and agree on FLUX_SHMEM_PLAN_CACHE and FLUX_SHMEM_CHECK_PLANS (caches that evict alike)."""
        got = self._exchange(f"{type(self).__name__}'s GEMM choices (PE 0's)",
                             (self._choices, self._plans.capacity, self.check_plans))
        mine = got[self.rt.rank][1:]
        if any(g[1:] != mine for g in got):
            per_pe = ", ".join(f"PE {i}: {g[1]} / {int(g[2])}" for i, g in enumerate(got))
            raise ValueError(f"PEs disagree on {PLAN_CACHE_ENV} / {CHECK_PLANS_ENV} ({per_pe}): give every PE the "
                             "same values (plan caches must evict alike)")
        self._tuned, self._forced, self._records, self._plain_gemm = got[0][0]

    # ---------------------------------------------------------------------------------------------------------
    def plan_inputs(self, **family) -> PlanInputs:
        """This op's planner inputs (`family`: the op's own fields of PlanInputs)."""
        return PlanInputs(family=self.family, world=self.rt.world_size, node_size=self.rt.node_size, n=self.n,
                          k=self.k, dtype=kconfig.dtype_name(self.dtype),
                          elem_bytes=torch.empty((), dtype=self.wire_dtype).element_size(), mode=self.mode,
                          budget_sms=self.budget.sms, sms=self.sms, cluster_m=self.cluster_m, links=self.links,
                          comm_blocks=self.comm_blocks, fused_configs=self.configs,
                          plain_configs=self.plain_configs(), tuned=self._tuned, forced=self._forced,
                          records=self._records, plain_gemm=self._plain_gemm, **family)

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
        """How a call with M = m and B layout `layout` runs (`plan_call`): the cached plan, else one planned now. A
        query: it leaves the plan cache as it is (repr or path() on one PE must not make that PE's cache evict
        differently). pin: keep the plan for the op's life (`prepare`)."""
        key = (m, layout)
        plan = self._plans.peek(key)
        if plan is None:
            not_capturing(f"{type(self).__name__} with M = {m}")
            plan = self._new_plan(m, layout)
        if pin:
            self._plans.pin(key, plan)
        return plan

    def _new_plan(self, m: int, layout: str) -> CallPlan:
        try:
            plan = plan_call(self.inputs, m, layout, self.rt.rank)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}: {e} ({self.budget.source})") from None
        return dataclasses.replace(plan, order=self._upload(plan.order)) if plan.order is not None else plan

    def plan_for_call(self, m: int, layout: str) -> CallPlan:
        """The plan a call runs. Calls are collective (every PE calls with the same M), so every PE's cache takes
        the same steps: the plan enters (or is touched in) the LRU, and inside a CUDA-graph capture it is pinned
        (the graph reads its tables). A capture cannot plan: a miss there raises, on every PE alike, naming
        prepare(). With FLUX_SHMEM_CHECK_PLANS=1 a plan's first call compares its digest across PEs."""
        key, in_capture = (m, layout), capturing()

        def make() -> CallPlan:
            if in_capture:
                raise RuntimeError(f"{type(self).__name__}: M = {m} ({layout}) has no plan inside this CUDA-graph "
                                   f"capture (a capture cannot plan): call op.prepare([{m}], layouts=('{layout}',)) "
                                   "on every PE before capturing")
            return self._new_plan(m, layout)
        plan = self._plans.entry(key, make, capturing=in_capture)
        if self.check_plans and key not in self._checked:
            self._check_plan(key, plan)
        return plan

    def _exchange(self, what: str, value) -> list:
        return collective.exchange(what, value, host=self.rt.host, timeout_s=self.rt.timeout_s)

    def _check_plan(self, key: tuple, plan: CallPlan) -> None:
        """FLUX_SHMEM_CHECK_PLANS=1: every PE's digest of this call's plan, compared (collective)."""
        got = self._exchange(f"{type(self).__name__}'s plan of M = {key[0]} ({key[1]})", plan_digest(plan))
        bad = [pe for pe, d in enumerate(got) if d != got[0]]
        if bad:
            raise RuntimeError(f"{type(self).__name__}: PEs planned M = {key[0]} ({key[1]}) differently: PE(s) "
                               f"{bad} differ from PE 0 ({got[bad[0]]} vs {got[0]}): their planner inputs or "
                               "plan caches diverged; report this with the ops' repr on each PE")
        self._checked.add(key)

    def _upload(self, order: list[int]) -> torch.Tensor:
        """A tile order table as the kernels read it (int32 on this PE's device)."""
        return torch.tensor(order, dtype=torch.int32, device=f"cuda:{self.rt.device}")

    def prepare(self, ms, layouts=("nk",)) -> None:
        """Make everything a call with each M of `ms` and B layout of `layouts` needs, now: its plan (pinned: the
        bounded cache never evicts it), the communication engines' device tables, the split-K workspace, cuBLAS's
        handle for this stream. The planner's host time then leaves the calls, and a CUDA graph captured
        afterwards (with no call before it) finds all made. Collective: every PE must prepare the same list, so
        that every PE's cache stays alike."""
        todo = []
        for layout in layouts:
            if layout not in self.layouts:
                raise ValueError(f"layout must be one of {self.layouts}, got {layout!r}")
            for m in ms:
                m = positive("m", int(m))
                if m > self.max_m or m % self.rt.world_size:
                    raise ValueError(f"{type(self).__name__}.prepare: M = {m} is not a multiple of the world size "
                                     f"{self.rt.world_size} up to max_m = {self.max_m}")
                todo.append((m, layout))
        symmetric.agree(f"{type(self).__name__}.prepare(ms, layouts) (every PE prepares the same)", todo,
                        host=self.rt.host, timeout_s=self.rt.timeout_s)
        not_capturing(f"{type(self).__name__}.prepare")
        for m, layout in todo:
            plan = self.call_plan(m, layout, pin=True)
            self._prepare_call(m, layout, plan)
            if plan.backend is not None and plan.backend.name == backends.CUBLAS:
                self._warm_cublas()
            elif plan.gemm is not None and plan.gemm.split > 1:  # our split-K workspace, allocated now
                cfg = registry.get(plan.gemm.config)  # (fp32 partial tiles of at most every tile, and locks)
                self.kernel(layout, cfg.name).workspace(4 * (m + cfg.tile_m) * (self.n + cfg.tile_n) + (1 << 20))

    def _prepare_call(self, m: int, layout: str, plan: CallPlan) -> None:
        """The family's device tables of a call with this plan, made and pinned now (`prepare`)."""

    def _warm_cublas(self) -> None:
        """One tiny cuBLAS GEMM of this op's dtype on the current stream: its handle and workspace exist before a
        capture."""
        dev = f"cuda:{self.rt.device}"
        if self.fp8:
            a = torch.zeros((16, 32), device=dev).to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        else:
            a = torch.zeros((16, 16), device=dev, dtype=self.dtype)
            torch.matmul(a, a)

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

    # ---------------------------------------------------------------------------------------------------------
    def _plain(self, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias, m: int,
               sm_count: int, choice: kconfig.Choice, scales: tuple[int, int, int]) -> None:
        """Our plain GEMM of this family into `out` (the family's kernel, no waits, no marks)."""
        raise NotImplementedError

    def gemm_only(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                  sm_count: Optional[int] = None, scale_a: torch.Tensor | None = None,
                  scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """The same GEMM (our CUTLASS kernel, whatever a call's plan would run) on an already gathered a [m, k]
        with no communication, into a fresh [m, n] tensor, on the whole SM budget (or `sm_count` CTAs, e.g. a
        fused call's gemm_sms), with the configuration the chooser picks for that many SMs: the honest twin."""
        what = f"{type(self).__name__}.gemm_only"
        layout = self.check_operands(a, b, bias, what)
        scales = self.check_scales(a, b, scale_a, scale_b, what)
        m = a.shape[0]
        if not 0 < m <= self.max_m:
            raise ValueError(f"a has {m} rows; this op takes M up to {self.max_m}")
        out = torch.empty((m, self.n), dtype=self.out_dtype, device=a.device)
        sms = sm_count or self.sms
        choice = self.gemm_choice(m, layout, sms)
        trace = stall.begin(what)
        self._plain(layout, a, b, out, bias, m, sms, choice, scales)
        if trace is not None:
            trace.stage(f"GEMM {choice.config} on {sms} CTAs finished", torch.cuda.current_stream(), "main")
        return out

    def plain_gemm(self, plan: CallPlan, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias,
                   m: int, scales: tuple[int, int, int], scale_a=None, scale_b=None) -> None:
        """The unfused GEMM of a call (decomposed path, one PE) into `out`, by the plan's backend: our kernel on
        the whole budget, or cuBLAS (torch.addmm / torch._scaled_mm with scale_a, scale_b as tensors)."""
        if plan.backend is not None and plan.backend.name == backends.CUBLAS:
            self._cublas(a, b, bias, out, scale_a, scale_b)
        else:
            self._plain(layout, a, b, out, bias, m, plan.gemm_sms, plan.gemm, scales)

    def _cublas(self, a: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor, scale_a, scale_b) -> None:
        if not self.fp8:
            if bias is None:
                torch.matmul(a, b, out=out)
            else:
                torch.addmm(bias, a, b, out=out)
            return
        # torch._scaled_mm takes both scales per tensor or both rowwise ([M, 1] and [1, N]): a mixed pair is
        # expanded to rowwise.
        m, n = a.shape[0], b.shape[1]
        sa, sb = scale_a.float().reshape(-1), scale_b.float().reshape(-1)
        if sa.numel() == 1 and sb.numel() == 1:
            sa, sb = sa.reshape(()), sb.reshape(())
        else:
            sa = sa.expand(m).reshape(m, 1).contiguous()
            sb = sb.expand(n).reshape(1, n).contiguous()
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16,
                         use_fast_accum=registry.fp8_fast_accum(), out=out)
