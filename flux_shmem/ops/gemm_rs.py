"""GEMMReduceScatter: out = reduce_scatter(a @ b, dim=0), the reduction hidden behind the GEMM.

The CUTLASS GEMM (csrc/gemm_rs.cu) writes this PE's partial product into a symmetric buffer and marks each
finished tile; the reduce-scatter engine (csrc/collectives.cu), started on a side stream with a few SMs once every
GEMM CTA runs, sums each unit (rows x a group of N-tiles) as soon as the node's PEs have finished the tiles under
it (NVLink loads), and across nodes sends node partials by put-with-signal. The PEs of a node compute in a common
order (`schedules.rs_tile_order`: other nodes' segments, then their own node's interleaved by M-tile), so
reductions run through the whole GEMM. What is left after the GEMM is the reduction of its last wave: the planner
(`search.plan_gemm_rs`) may walk swizzle groups of several M-tiles (several owners' segments) with units a part
of a row wide, so that each wave completes a part of every owner's rows and the last wave's reductions are shared
by as many PEs, and may hand the last wave's units to a wide tail kernel launched after the GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import backends
from ..kernels import gemm as kgemm
from ..kernels import module as kmodule
from ..kernels import registry
from ..plan import search
from ..plan.schedules import default_unit_rows
from ..runtime import collective, signals, stall, symmetric
from ._fused import FusedGEMM
from ._validate import positive
from .reduce_scatter import ReduceEngine, ReduceScatter, done_protocol

# Decomposed calls of up to this many rows with the cuBLAS GEMM run cuBLAS into a standalone ReduceScatter's input
# buffer, then that op: no barrier of every PE, no separate marking of the tiles, the done signal in its kernel.
# Measured 25-95 us faster than the engine's decomposed call at M <= 2048 (H100, 2 and 4 PEs under MPS, 2026-12-07:
# the calls there are host-bound); its buffer costs rows x n x 2 bytes of symmetric memory (32 MB at n = 8192).
PLAIN_RS_ROWS = 2048


class GEMMReduceScatter(FusedGEMM):
    """out[m / world, n] = rows [r*m/world, (r+1)*m/world) of sum over PEs of a[m, k] @ b[k, n] (+ bias[n] once).

    `k` is this PE's share of the reduction dimension (K / world in tensor parallelism). Built once per
    (max_m, n, k, dtype) (collective), called on torch's current stream. b may be row-major [k, n] or a
    transposed [n, k] weight. mode: 'fused', 'decomposed' (GEMM on all SMs, then the reduce-scatter) or 'auto'
    (fused when the simulator predicts it faster; the choice shows in repr). comm_blocks: SMs of the reduce
    kernel; group_tiles: the fused reduce units' width in N-tiles (a large value: whole rows); by default both are
    the split the simulator predicts fastest.

    fp8: dtype=torch.float8_e4m3fn takes e4m3 a and b (b the transpose of an [n, k] weight) with fp32 scales at
    each call (`scale_a`: [] or one per row of a; `scale_b`: [] or one per column of b, as torch._scaled_mm); each
    PE's partial scale_a * scale_b * (a @ b) is bf16, the reduction sums in fp32 and the output (and bias) is bf16.
    """

    family = "gemm_rs"
    DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    COMM_CANDIDATES = (4, 8, 16, 24)

    def __init__(self, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *, mode: str = "auto",
                 unit_rows: int | None = None, comm_blocks: Optional[int] = None,
                 group_tiles: Optional[int] = None):
        with collective.all_or_none("GEMMReduceScatter construction"):  # an error on one PE reaches every PE
            self._construct(max_m, n, k, dtype, mode, unit_rows, comm_blocks, group_tiles)

    def _construct(self, max_m, n, k, dtype, mode, unit_rows, comm_blocks, group_tiles) -> None:
        super().__init__(max_m, n, k, dtype, mode, comm_blocks)
        self.group_tiles = positive("group_tiles", group_tiles) if group_tiles is not None else None
        rt = self.rt
        elem = torch.empty((), dtype=self.out_dtype).element_size()
        unit_rows = positive("unit_rows", unit_rows) if unit_rows is not None else \
            default_unit_rows(n, elem, self.tile_m)
        # the collective part: every PE got here
        # (FLUX_SHMEM_RS_DONE: one PE waiting on done flags that another never sets would hang: agreed)
        self.done_protocol = done_protocol()
        symmetric.agree("GEMMReduceScatter(max_m, n, k, dtype, mode, unit_rows, comm_blocks, group_tiles, "
                        "FLUX_SHMEM_RS_DONE)",
                        (max_m, n, k, str(dtype), mode, unit_rows, comm_blocks, group_tiles, self.done_protocol))
        self.share_choices()
        self.inputs = self.plan_inputs()
        # One configuration for the op's life: the reduce engine waits until each peer's counter of an M-tile
        # reaches epoch x N-tiles, so the tile width may change neither between calls nor between PEs (whose
        # choices agree: PlanInputs).
        self.configs = (self.gemm_choice(max_m, "nk", self.sms, fused=True).config,)  # (nk: every dtype has it)
        # Fires once every GEMM CTA runs; the reduce kernel follows it, so its blocks stay off the GEMM's SMs.
        self.gemm_started = kmodule.StartEvent() if self.guarded else None
        self.engine = ReduceEngine(rt, max_m, n, self.out_dtype, unit_rows=unit_rows, tile_m=self.tile_m,
                                   comm_blocks=self.comm_blocks or max(search.RS_COMM_BLOCKS),
                                   tile_n=registry.get(self.configs[0]).tile_n, cluster_m=self.cluster_m)
        rows = min(max_m, PLAIN_RS_ROWS) // rt.world_size * rt.world_size
        self.plain_rs = ReduceScatter(rows, n, self.out_dtype, comm_blocks=self.engine.comm_blocks) \
            if rt.world_size > 1 and rows > 0 and (n * elem) % 16 == 0 else None
        self.agree_inputs(unit_rows=unit_rows, group_tiles=self.group_tiles,
                          decomposed_comm_blocks=self.engine.comm_blocks)

    def __repr__(self) -> str:
        small = (f"decomposed cuBLAS calls of M <= {self.plain_rs.max_rows}: cuBLAS + ReduceScatter, "
                 if self.plain_rs else "")
        return (f"GEMMReduceScatter(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, "
                f"mode={self.mode}, world={self.rt.world_size}, node_size={self.rt.node_size}, "
                f"config={self.configs[0]}, unit_rows={self.engine.unit_rows}, "
                f"{small}"
                f"sm_budget={self.budget.sms} "
                f"({self.budget.source}), at max_m: {self.call_plan(self.max_m).describe()})")

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.out_dtype  # the partials (bf16 for fp8 operands)

    def plain_configs(self) -> tuple[str, ...]:
        # Both paths count finished tiles per M-tile of the op's tile height (the reduce engine waits on them).
        return self.configs

    def _gemm(self, layout: str, a: torch.Tensor, b: torch.Tensor, d_ptr: int, bias, m: int, *, counters: bool,
              sm_count: int, order: torch.Tensor | None, swizzle: int, choice, started=None,
              scales: tuple[int, int, int] = (0, 0, 0)) -> None:
        rt, eng = self.rt, self.engine
        args = kgemm.FsGemmRsArgs(
            m=m, n=self.n, k=self.k, a=a.data_ptr(), b=b.data_ptr(), d=d_ptr,
            bias=bias.data_ptr() if bias is not None else 0, sm_count=sm_count, device_id=rt.device,
            tile_ready=eng.tile_ready.data_ptr() if counters else 0, epoch=eng.sync.epoch.data_ptr(),
            m_tile_order=order.data_ptr() if order is not None else 0, swizzle=swizzle, ctx=signals.ctx(),
            splits=choice.split, tail_chunks=choice.chunks, scale_a=scales[0], scale_b=scales[1],
            scale_kind=scales[2])
        self.kernel(layout, choice.config).launch(args, started=started)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> torch.Tensor:
        signals.check_errors()
        rt, eng = self.rt, self.engine
        layout = self.check_operands(a, b, bias, "GEMMReduceScatter")
        scales = self.check_scales(a, b, scale_a, scale_b, "GEMMReduceScatter")
        m = a.shape[0]
        if not 0 < m <= self.max_m or m % rt.world_size:
            raise ValueError(f"a has {m} rows; this op takes M a multiple of the world size {rt.world_size}, up "
                             f"to {self.max_m}")
        plan = self.plan_for_call(m, layout)
        if rt.world_size == 1:  # nothing to reduce: the plain GEMM (ours or cuBLAS), bias included
            out = torch.empty((m, self.n), dtype=self.out_dtype, device=a.device)
            self.plain_gemm(plan, layout, a, b, out, bias, m, scales, scale_a, scale_b)
            return out
        if self.plain_rs_runs(plan, m):
            buf = self.plain_rs.input_buffer(m)  # (waits until no node peer still reads it)
            self._cublas(a, b, None, buf, scale_a, scale_b)
            return self.plain_rs(buf, bias=bias)
        out = torch.empty((m // rt.world_size, self.n), dtype=self.out_dtype, device=a.device)
        main = torch.cuda.current_stream()
        trace = stall.begin("GEMMReduceScatter")
        self._no_reader(main)  # nobody still reads my partial
        if trace is not None:
            trace.stage("done flags (node peers past my previous partial)" if self.done_protocol else
                        "barrier (every PE past its previous call)", main, "main")
        if plan.path == "fused":
            # The GEMM never waits on the reduce kernel, which waits on the GEMM's tiles: the GEMM goes first and
            # the reduce kernel starts once all GEMM CTAs run. Seen 2026-12-03 with the reduce kernel first and the
            # GEMM waiting for its arrival signal: PEs sharing a GPU under MPS whose GEMMs never got SMs.
            self.comm_stream.wait_stream(main)
            # The reduce plan follows the order in which this GEMM (tile order, swizzle) completes its pieces.
            shape = dict(swizzle=plan.swizzle, group_tiles=plan.group_tiles or None, tail=plan.tail,
                         tail_blocks=plan.tail_blocks)
            self._gemm(layout, a, b, eng.partial.data_ptr(), None, m, counters=True, sm_count=plan.gemm_sms,
                       order=plan.order, swizzle=plan.swizzle, choice=plan.gemm, started=self.gemm_started,
                       scales=scales)
            if trace is not None:
                trace.stage(f"fused GEMM ({plan.gemm_sms} CTAs) finished", main, "main")
            if self.gemm_started is not None:
                self.gemm_started.wait(self.comm_stream)
            eng.launch(m, out, src=None, bias=bias, stream=self.comm_stream, blocks=plan.comm_blocks, **shape)
            if trace is not None:
                trace.stage(f"reduce kernel ({plan.comm_blocks} blocks) finished", self.comm_stream, "comm")
            # The last wave's reductions, on every SM the GEMM just left.
            eng.launch(m, out, src=None, bias=bias, stream=main, blocks=plan.comm_blocks, part="tail", **shape)
            main.wait_stream(self.comm_stream)
            if self.done_protocol:  # (two reduce launches: the signal follows both)
                eng.signal_done(main)
            if not torch.cuda.is_current_stream_capturing():
                out.record_stream(self.comm_stream)
        elif plan.backend is not None and plan.backend.name == backends.CUBLAS:
            # cuBLAS writes the partial; then every tile of it is marked ready at once (the reduce kernel waits on
            # the marks of its node peers' partials). The marks follow the GEMM on this stream, after its writes
            # are done: a peer that sees a mark sees the tile.
            self._cublas(a, b, None, eng.partial[:m], scale_a, scale_b)
            tiles = -(-m // self.tile_m) * eng.tiles_n
            eng.tile_ready[:tiles].copy_(eng.sync.epoch.expand(tiles))
            eng.launch(m, out, src=None, bias=bias, stream=main, signal_done=self.done_protocol)
        else:
            self._gemm(layout, a, b, eng.partial.data_ptr(), None, m, counters=True, sm_count=plan.gemm_sms,
                       order=None, swizzle=plan.swizzle, choice=plan.gemm, scales=scales)
            eng.launch(m, out, src=None, bias=bias, stream=main, signal_done=self.done_protocol)
        eng.sync.bump(main)
        if trace is not None:
            trace.stage("call done (epoch bumped)", main, "main")
            for label, t in (("epoch", eng.sync.epoch), ("barrier slots", eng.sync.bar),
                             ("tile-ready words", eng.tile_ready)):
                trace.word(label, t)
        return out

    def fused_gemm_alone(self, a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor | None = None,
                         scale_b: torch.Tensor | None = None) -> torch.Tensor:
        """Diagnostic: the GEMM of a fused call exactly as planned (CTAs, tile order, swizzle, tile marks) with no
        reduce kernel beside it; returns this PE's partial [m, n] (the op's buffer: read it before the next call).
        Timed against the fused call's GEMM stage it separates the reduce kernel's interference from the GEMM's
        own plan. Collective like a call (a barrier first: no peer still reads the partial)."""
        layout = self.check_operands(a, b, None, "GEMMReduceScatter.fused_gemm_alone")
        scales = self.check_scales(a, b, scale_a, scale_b, "GEMMReduceScatter.fused_gemm_alone")
        m = a.shape[0]
        plan = self.call_plan(m, layout)
        if plan.path != "fused":
            raise ValueError(f"M = {m} runs the {plan.path} path: there is no fused GEMM to time alone")
        main = torch.cuda.current_stream()
        self._no_reader(main)
        self._gemm(layout, a, b, self.engine.partial.data_ptr(), None, m, counters=True, sm_count=plan.gemm_sms,
                   order=plan.order, swizzle=plan.swizzle, choice=plan.gemm, scales=scales)
        if self.done_protocol:  # (no peer reads this partial: the next call may overwrite it)
            self.engine.signal_done(main)
        self.engine.sync.bump(main)  # the marks this GEMM set belong to a finished epoch
        return self.engine.partial[:m]

    def plain_rs_runs(self, plan, m: int) -> bool:
        """Whether a call with this plan runs cuBLAS + the standalone ReduceScatter (PLAIN_RS_ROWS)."""
        return (self.plain_rs is not None and plan.path == "decomposed" and m <= self.plain_rs.max_rows and
                plan.backend is not None and plan.backend.name == backends.CUBLAS)

    def _no_reader(self, stream) -> None:
        """Hold `stream` until no PE still reads my partial of the previous call: a barrier of every PE, or with
        the done protocol (FLUX_SHMEM_RS_DONE=1) the done flags my node peers' previous call set."""
        if self.done_protocol:
            self.engine.wait_done(stream)
        else:
            self.engine.sync.barrier(stream)

    def _prepare_call(self, m: int, layout: str, plan) -> None:
        if self.rt.world_size == 1:
            return
        if self.plain_rs_runs(plan, m):
            eng = self.plain_rs.engine
            eng.plan(m, eng.comm_blocks, True, pin=True)
            return
        eng = self.engine
        if plan.path == "fused":
            shape = dict(swizzle=plan.swizzle, group_tiles=plan.group_tiles or None, tail=plan.tail,
                         tail_blocks=plan.tail_blocks)
            eng.plan(m, plan.comm_blocks, False, **shape, pin=True)
        else:
            eng.plan(m, eng.comm_blocks, False, pin=True)

    def _plain(self, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias, m: int,
               sm_count: int, choice, scales: tuple[int, int, int]) -> None:
        self._gemm(layout, a, b, out.data_ptr(), bias, m, counters=False, sm_count=sm_count, order=None,
                   swizzle=choice.swizzle, choice=choice, scales=scales)
