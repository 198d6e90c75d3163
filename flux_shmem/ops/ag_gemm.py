"""AllGatherGEMM: out = all_gather(a_shard, dim=0) @ b, the gather hidden inside one persistent GEMM.

Two engines run at once: the all-gather on a side stream, pushing each shard chunk by chunk and raising one
signal per (source PE, chunk), either with a kernel on a few SMs (csrc/collectives.cu, engine 'sm') or with the
copy engines (engine 'ce', one NVLink domain); and the CUTLASS GEMM (csrc/ag_gemm.cu) on the current stream with
the other SMs, whose TMA producer waits for the signal of the chunk holding a tile's rows before loading it.
Tiles are visited local shard first, then node peers, then other nodes.
"""
from __future__ import annotations

import torch

from ..kernels import gemm as kgemm
from ..runtime import signals, symmetric
from ._fused import FusedGEMM
from ._schedule import ag_segment_order
from ._validate import positive
from .all_gather import AllGather


class AllGatherGEMM(FusedGEMM):
    """out[m, n] = all_gather(a_shard)[m, k] @ b[k, n] (+ bias[n]); a_shard is [m / world, k] on every PE.

    Built once per (max_m, n, k, dtype) (collective), called on torch's current stream. `n` is this PE's column
    count (N / world in tensor parallelism). b may be row-major [k, n] or a transposed [n, k] weight (w.t()).
    mode: 'fused' (one overlapped kernel pair), 'decomposed' (all-gather, then GEMM on all SMs) or 'auto'
    (fused unless the GEMM is too small to hide anything). `chunk_rows` sets the signal granularity.
    engine: 'sm' (default) moves data with a gather kernel on `comm_blocks` SMs (NVLink stores inside a node,
    NVSHMEM puts across nodes); 'ce' moves it with the copy engines (one NVLink domain only), so the GEMM keeps
    all SMs but one.
    """

    family = "ag_gemm"
    segment_order = staticmethod(ag_segment_order)

    ENGINES = ("sm", "ce")

    def __init__(self, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *, mode: str = "auto",
                 chunk_rows: int | None = None, comm_blocks: int = 8, engine: str = "sm"):
        if engine not in self.ENGINES:
            raise ValueError(f"engine must be one of {self.ENGINES} ('sm': a gather kernel on comm_blocks SMs; "
                             f"'ce': copy engines, one NVLink domain only), got {engine!r}")
        self.engine = engine
        # The copy engines need no SMs; one is left for the barrier kernel that runs beside the persistent GEMM.
        super().__init__(max_m, n, k, dtype, mode, comm_blocks if engine == "sm" else 1)
        W = self.rt.world_size
        ms = max_m // W
        if chunk_rows is None:  # about four chunks per shard, in whole tiles
            quarter = -(-ms // 4)
            chunk_rows = min(ms, -(-quarter // self.tile_m) * self.tile_m)
        self.ag = AllGather(ms, k, dtype, chunk_rows=chunk_rows, comm_blocks=positive("comm_blocks", comm_blocks))
        symmetric.agree("AllGatherGEMM(max_m, n, k, dtype, mode, engine)", (max_m, n, k, str(dtype), mode, engine))
        if engine == "ce" and not self.ag.ce_capable:
            raise ValueError("AllGatherGEMM(engine='ce') needs every PE in one NVLink domain (one node, no "
                             "FLUX_SHMEM_FORCE_PUT); use engine='sm', which also crosses nodes")

    def __repr__(self) -> str:
        return (f"AllGatherGEMM(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, mode={self.mode}, "
                f"world={self.rt.world_size}, node_size={self.rt.node_size}, tile={self.tile_m}x{self.tile_n}, "
                f"chunk_rows={self.ag.chunk_rows}, engine={self.engine}, gemm_sms={self.gemm_sms}, "
                f"comm_blocks={self.ag.comm_blocks if self.engine == 'sm' else 0}, "
                f"path at max_m: {self.path(self.max_m)})")

    def _gemm(self, layout: str, a_ptr: int, b: torch.Tensor, out: torch.Tensor, bias, m: int, *, wait: bool,
              sm_count: int, order: torch.Tensor | None) -> None:
        ag = self.ag
        ms = max(1, m // self.rt.world_size)
        args = kgemm.FsAgGemmArgs(
            m=m, n=self.n, k=self.k, a=a_ptr, b=b.data_ptr(), d=out.data_ptr(),
            bias=bias.data_ptr() if bias is not None else 0, sm_count=sm_count, device_id=self.rt.device,
            chunk_flags=ag.flags.data_ptr(), epoch=ag.sync.epoch.data_ptr(), rows_per_shard=ms,
            chunk_rows=ag.chunk_rows, chunks_per_shard=-(-ms // ag.chunk_rows), wait=int(wait),
            m_tile_order=order.data_ptr() if order is not None else 0, swizzle=self.swizzle(m, fused=wait),
            ctx=signals.ctx())
        self._gemms[layout].launch(args)

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 return_gathered: bool = False):
        signals.check_errors()
        rt = self.rt
        layout = self.check_operands(a_shard, b, bias, "AllGatherGEMM")
        ms = a_shard.shape[0]
        m = ms * rt.world_size
        if not 0 < m <= self.max_m:
            raise ValueError(f"a_shard has {ms} rows (M = {m}); this op takes M up to {self.max_m}")
        if rt.world_size == 1:  # nothing to gather: the plain GEMM on the shard
            out = self.gemm_only(a_shard, b, bias)
            return (out, a_shard.clone()) if return_gathered else out
        out = torch.empty((m, self.n), dtype=self.dtype, device=a_shard.device)
        main = torch.cuda.current_stream()
        ag = self.ag
        if self.path(m) == "fused":
            self.comm_stream.wait_stream(main)
            if self.engine == "ce":
                ag.launch_ce(a_shard, stream=self.comm_stream)
            else:
                ag.launch(a_shard, stream=self.comm_stream, wait_all=False)
            if not torch.cuda.is_current_stream_capturing():  # the allocator must not reuse it early
                a_shard.record_stream(self.comm_stream)
            self._gemm(layout, ag.gather.data_ptr(), b, out, bias, m, wait=True, sm_count=self.gemm_sms,
                       order=self.order(m))
            main.wait_stream(self.comm_stream)
        else:
            ag.launch(a_shard, stream=main, wait_all=True)
            self._gemm(layout, ag.gather.data_ptr(), b, out, bias, m, wait=False, sm_count=self.sms, order=None)
        ag.sync.bump(main)
        if return_gathered:
            return out, ag.gather[:m].clone()
        return out

    def gemm_only(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The same GEMM on an already gathered a [m, k], all SMs, no communication: the honest baseline."""
        layout = self.check_operands(a, b, bias, "AllGatherGEMM.gemm_only")
        m = a.shape[0]
        if not 0 < m <= self.max_m:
            raise ValueError(f"a has {m} rows; this op takes M up to {self.max_m}")
        out = torch.empty((m, self.n), dtype=self.dtype, device=a.device)
        self._gemm(layout, a.data_ptr(), b, out, bias, m, wait=False, sm_count=self.sms, order=None)
        return out
