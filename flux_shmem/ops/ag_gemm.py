"""AllGatherGEMM: out = all_gather(a_shard, dim=0) @ b, the gather hidden inside one persistent GEMM.

Two engines run at once: the all-gather on a side stream, pushing each shard chunk by chunk and raising one
signal per (source PE, chunk), either with a kernel on a few SMs (csrc/collectives.cu, engine 'sm') or with the
copy engines (engine 'ce', one NVLink domain); and the CUTLASS GEMM (csrc/ag_gemm.cu) on the current stream with
the other SMs, whose TMA producer waits for the signal of the chunk holding a tile's rows before loading it.
The GEMM visits M-tiles in the order their rows are predicted to arrive (`schedules.ag_tile_order` on the
simulator's arrivals), and each scheduler swizzle group stays inside one chunk, so it consumes what has landed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import gemm as kgemm
from ..kernels import registry
from ..runtime import collective, pacing, signals, stall, symmetric
from ..plan import search
from ._fused import FusedGEMM
from ..plan.schedules import fused_chunk_rows
from .all_gather import AllGather, ce_capable


class AllGatherGEMM(FusedGEMM):
    """out[m, n] = all_gather(a_shard)[m, k] @ b[k, n] (+ bias[n]); a_shard is [m / world, k] on every PE.

    Built once per (max_m, n, k, dtype) (collective), called on torch's current stream. `n` is this PE's column
    count (N / world in tensor parallelism). b may be row-major [k, n] or a transposed [n, k] weight (w.t()).
    mode: 'fused' (one overlapped kernel pair), 'decomposed' (all-gather, then GEMM on all SMs) or 'auto'
    (fused when the simulator predicts it faster; repr says why). `chunk_rows` sets the signal granularity.
    engine: 'sm' moves data with a gather kernel on `comm_blocks` SMs (NVLink stores inside a node, NVSHMEM puts
    across nodes; default comm_blocks: the split the simulator predicts fastest); 'ce' moves it with the copy
    engines (one NVLink domain only), so the GEMM keeps all SMs but one; 'auto' (default) takes whichever the
    simulator predicts faster for each M ('sm' where the copy engines cannot serve: several nodes, forced puts,
    link emulation).

    fp8: dtype=torch.float8_e4m3fn gathers e4m3 rows (half the bytes of bf16) and takes fp32 scales per call:
    `scale_a` for this PE's shard ([] or one per shard row), `scale_b` ([] or one per column of b); out (and
    bias) bf16. The shards' scales are all-gathered first (a small all-gather, on the main stream, before the
    fused pair) into one scale per row of the gathered A, which the GEMM's epilogue applies.
    """

    family = "ag_gemm"
    DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    ENGINES = ("auto", "sm", "ce")
    COMM_CANDIDATES = (2, 4, 8, 16)

    def __init__(self, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *, mode: str = "auto",
                 chunk_rows: int | None = None, comm_blocks: Optional[int] = None, engine: str = "auto"):
        with collective.all_or_none("AllGatherGEMM construction"):  # an error on one PE reaches every PE
            self._construct(max_m, n, k, dtype, mode, chunk_rows, comm_blocks, engine)

    def _construct(self, max_m, n, k, dtype, mode, chunk_rows, comm_blocks, engine) -> None:
        if engine not in self.ENGINES:
            raise ValueError(f"engine must be one of {self.ENGINES} ('sm': a gather kernel on comm_blocks SMs; "
                             f"'ce': copy engines, one NVLink domain only; 'auto': the faster), got {engine!r}")
        self.engine = engine
        super().__init__(max_m, n, k, dtype, mode, comm_blocks)
        rt = self.rt
        W = rt.world_size
        one_domain = ce_capable(rt)
        if engine == "ce" and not one_domain:
            raise ValueError("AllGatherGEMM(engine='ce') needs every PE in one NVLink domain (one node, no "
                             "FLUX_SHMEM_FORCE_PUT); use engine='sm', which also crosses nodes")
        if engine == "ce" and self.emulation is not None:
            raise ValueError("link emulation (FLUX_SHMEM_LINK_GBPS) paces the SM engine only; the copy engines "
                             "cannot be paced: use engine='sm' or unset FLUX_SHMEM_LINK_GBPS")
        self._engines = {"sm": ("sm",), "ce": ("ce",)}.get(engine) or \
            search.ag_engines(one_domain, self.emulation is not None, W)
        ms = max_m // W
        if chunk_rows is None:
            chunk_rows = fused_chunk_rows(ms, k * torch.empty((), dtype=dtype).element_size(), self.tile_m)
        # the collective part: every PE got here
        symmetric.agree("AllGatherGEMM(max_m, n, k, dtype, mode, engine, comm_blocks)",
                        (max_m, n, k, str(dtype), mode, engine, comm_blocks))
        self.share_choices()
        self.ag = AllGather(ms, k, dtype, chunk_rows=chunk_rows,
                            comm_blocks=self.comm_blocks or max(search.AG_COMM_BLOCKS),
                            copy_engine="ce" in self._engines)
        # fp8: every shard's scales, one per shard row (a per-tensor scale expanded), packed 4 fp32 to a 16-byte
        # row and gathered before a call: always the same size, so PEs passing different scale kinds still gather
        # alike (and each row gets its shard's own scale)
        self.scale_ag = AllGather(-(-ms // 4), 4, torch.float32, comm_blocks=1) if self.fp8 else None
        self.agree_inputs(engines=self._engines, chunk_rows=self.ag.chunk_rows,
                          decomposed_comm_blocks=self.ag.comm_blocks)

    def __repr__(self) -> str:
        return (f"AllGatherGEMM(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, mode={self.mode}, "
                f"world={self.rt.world_size}, node_size={self.rt.node_size}, tile_m={self.tile_m}, "
                f"chunk_rows={self.ag.chunk_rows}, engine={self.engine}, sm_budget={self.budget.sms} "
                f"({self.budget.source}), at max_m: {self.call_plan(self.max_m).describe()})")

    def gather_scales(self, scale_a: torch.Tensor, ms: int) -> torch.Tensor:
        """fp8: every PE's shard scales (per-tensor [] or one per row, [ms]) as one fp32 scale per row of the
        gathered A, [world * ms] (collective; on torch's current stream). Each PE sends ms of them whatever its
        kind (a per-tensor scale expanded): the gather's size never depends on a PE's own choice."""
        W = self.rt.world_size
        rows4 = -(-ms // 4)
        packed = torch.zeros((rows4, 4), dtype=torch.float32, device=scale_a.device)
        packed.view(-1)[:ms] = scale_a.reshape(-1).expand(ms) if scale_a.numel() == 1 else scale_a.reshape(-1)
        return self.scale_ag(packed, copy=False).reshape(W, rows4 * 4)[:, :ms].contiguous().reshape(-1)

    def _gemm(self, layout: str, a_ptr: int, b: torch.Tensor, out: torch.Tensor, bias, m: int, *, wait: bool,
              sm_count: int, order: torch.Tensor | None, swizzle: int, choice, engine: str = "sm",
              scales: tuple[int, int, int] = (0, 0, 0)) -> None:
        ag = self.ag
        ms = max(1, m // self.rt.world_size)
        # The copy-engine flags are set to 1 (then zeroed by their owner); the SM engine's to the epoch.
        target = ag.one if engine == "ce" else ag.sync.epoch
        flags = ag.ce_flags if engine == "ce" else ag.flags
        args = kgemm.FsAgGemmArgs(
            m=m, n=self.n, k=self.k, a=a_ptr, b=b.data_ptr(), d=out.data_ptr(),
            bias=bias.data_ptr() if bias is not None else 0, sm_count=sm_count, device_id=self.rt.device,
            chunk_flags=flags.data_ptr(), epoch=target.data_ptr(), rows_per_shard=ms,
            chunk_rows=ag.chunk_rows, chunks_per_shard=-(-ms // ag.chunk_rows), wait=int(wait),
            m_tile_order=order.data_ptr() if order is not None else 0, swizzle=swizzle, ctx=signals.ctx(),
            splits=choice.split, tail_chunks=choice.chunks, scale_a=scales[0], scale_b=scales[1],
            scale_kind=scales[2])
        self.kernel(layout, choice.config).launch(args)

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 return_gathered: bool = False, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None):
        signals.check_errors()
        rt = self.rt
        layout = self.check_operands(a_shard, b, bias, "AllGatherGEMM")
        scales = self.check_scales(a_shard, b, scale_a, scale_b, "AllGatherGEMM")
        ms = a_shard.shape[0]
        m = ms * rt.world_size
        if not 0 < m <= self.max_m:
            raise ValueError(f"a_shard has {ms} rows (M = {m}); this op takes M up to {self.max_m}")
        plan = self.plan_for_call(m, layout)
        out = torch.empty((m, self.n), dtype=self.out_dtype, device=a_shard.device)
        if rt.world_size == 1:  # nothing to gather: the plain GEMM on the shard (ours or cuBLAS)
            self.plain_gemm(plan, layout, a_shard, b, out, bias, m, scales, scale_a, scale_b)
            return (out, a_shard.clone()) if return_gathered else out
        if self.fp8:  # one scale per gathered row (kept alive by the allocator until the GEMM is done)
            row_scales = self.gather_scales(scale_a, ms)
            scales = (row_scales.data_ptr(), scales[1], scales[2] | kgemm.SCALE_ROWWISE_A)
        main = torch.cuda.current_stream()
        ag = self.ag
        trace = stall.begin("AllGatherGEMM")
        if plan.path == "fused":
            self.comm_stream.wait_stream(main)
            if trace is not None:
                trace.stage("comm stream past the caller's prior work", self.comm_stream, "comm")
            if plan.engine == "ce":
                ag.launch_ce(a_shard, stream=self.comm_stream)
                # The GEMM starts once the barrier kernel is done (seen 2026-12-03, 4 PEs under MPS: every PE's
                # GEMM spinning on CE flags whose copies waited behind a barrier kernel that had not run).
                main.wait_event(ag.ce_barrier_done)
            else:
                # The GEMM starts once every gather block runs (a flag the kernel's own blocks raise: CUDA's
                # launch-completion event was seen to hold nothing back under MPS).
                cfg = registry.get(plan.gemm.config)
                ag.launch(a_shard, stream=self.comm_stream, wait_all=False, blocks=plan.comm_blocks,
                          gate=self.guarded, cluster=cfg.cluster_m * cfg.cluster_n)
                if trace is not None:
                    trace.stage(f"gather kernel ({plan.comm_blocks} blocks) finished", self.comm_stream, "comm")
                if self.guarded:
                    ag.wait_started(main)
                    if trace is not None:
                        trace.stage("start gate opened (every gather block ran)", main, "main")
            if not torch.cuda.is_current_stream_capturing():  # the allocator must not reuse it early
                a_shard.record_stream(self.comm_stream)
            self._gemm(layout, ag.gather.data_ptr(), b, out, bias, m, wait=True, sm_count=plan.gemm_sms,
                       order=plan.order, swizzle=plan.swizzle, choice=plan.gemm, engine=plan.engine, scales=scales)
            if trace is not None:
                trace.stage(f"fused GEMM ({plan.gemm_sms} CTAs) finished", main, "main")
            main.wait_stream(self.comm_stream)
            if plan.engine == "ce":
                ag.ce_done(main)
        else:
            gathered = ag.launch(a_shard, stream=main, wait_all=True)
            self.plain_gemm(plan, layout, gathered, b, out, bias, m, scales,
                            row_scales if self.fp8 else None, scale_b)
        ag.sync.bump(main)
        if trace is not None:
            trace.stage("call done (epoch bumped)", main, "main")
            for label, t in (("epoch", ag.sync.epoch), ("gate [started blocks, open]", ag._gate),
                             ("barrier slots", ag.sync.bar), ("chunk flags", ag.flags),
                             ("emulated link clocks (ns)", pacing.clock(self.rt.device))):
                if t is not None:
                    trace.word(label, t)
        if return_gathered:
            return out, ag.gather[:m].clone()
        return out

    def _prepare_call(self, m: int, layout: str, plan) -> None:
        if self.rt.world_size == 1:
            return
        ms = m // self.rt.world_size
        if plan.path == "fused" and plan.engine == "sm":
            cfg = registry.get(plan.gemm.config)
            self.ag.plan(ms, plan.comm_blocks, cfg.cluster_m * cfg.cluster_n, pin=True)
        elif plan.path == "fused":
            self.ag.peers()
        else:
            self.ag.plan(ms, self.ag.comm_blocks, pin=True)
        if self.fp8:
            self.scale_ag.plan(-(-ms // 4), self.scale_ag.comm_blocks, pin=True)

    def _plain(self, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias, m: int,
               sm_count: int, choice, scales: tuple[int, int, int]) -> None:
        self._gemm(layout, a.data_ptr(), b, out, bias, m, wait=False, sm_count=sm_count, order=None,
                   swizzle=choice.swizzle, choice=choice, scales=scales)
