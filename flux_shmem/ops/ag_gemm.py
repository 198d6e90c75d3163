"""AllGatherGEMM: out = all_gather(a_shard, dim=0) @ b, the gather hidden inside one persistent GEMM.

Two kernels run at once: the all-gather engine (csrc/collectives.cu) on a side stream with a few SMs, pushing
each shard chunk by chunk and raising one signal per (source PE, chunk); and the CUTLASS GEMM (csrc/ag_gemm.cu)
on the current stream with the other SMs, whose TMA producer waits for the signal of the chunk holding a tile's
rows before loading it. Tiles are visited local shard first, then node peers, then other nodes.
"""
from __future__ import annotations

import torch

from ..kernels import gemm as kgemm
from ..runtime import signals, symmetric
from ..runtime.bootstrap import get_runtime
from ._schedule import ag_segment_order, m_tile_order
from ._validate import check_dtype, check_tensor, positive
from .all_gather import AllGather

MODES = ("auto", "fused", "decomposed")


def b_layout_of(b: torch.Tensor) -> str:
    """'kn' for a row-major [K, N] b, 'nk' for the transpose of a row-major [N, K] weight (b = w.t())."""
    if b.is_contiguous():
        return "kn"
    if b.t().is_contiguous():
        return "nk"
    raise ValueError("b must be row-major [K, N] or the transpose of a row-major [N, K] tensor (w.t()): pass "
                     "b.contiguous()")


def check_operands(name: str, rt, a: torch.Tensor, b: torch.Tensor, bias, dtype, k: int, n: int) -> str:
    check_tensor("a", a, dtype=dtype, device=rt.device)
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise ValueError(f"b must be a 2-D tensor [K, N], got {getattr(b, 'shape', type(b).__name__)}")
    if b.dtype != dtype or b.device != a.device:
        raise TypeError(f"b has {b.dtype} on {b.device}; {name} needs {dtype} on {a.device}")
    if tuple(b.shape) != (k, n):
        raise ValueError(f"b has shape {tuple(b.shape)}; {name} was built for [K, N] = [{k}, {n}]")
    if a.shape[1] != k:
        raise ValueError(f"a has {a.shape[1]} columns; {name} was built for K = {k}")
    if b.data_ptr() % 16:
        raise ValueError("b must start on a 16-byte boundary: pass a fresh tensor or b.clone()")
    if bias is not None:
        check_tensor("bias", bias, dtype=dtype, device=rt.device, ndim=1)
        if bias.shape[0] != n:
            raise ValueError(f"bias has {bias.shape[0]} entries, expected N = {n}")
    return b_layout_of(b)


def check_k_n(name: str, k: int, n: int) -> None:
    # TMA needs 16-byte aligned row strides: K and N multiples of 8 for 16-bit types.
    for what, v in (("K", k), ("N", n)):
        if v % 8:
            raise ValueError(f"{name}: {what} = {v} is not a multiple of 8 (TMA needs 16-byte rows); pad {what} "
                             "to a multiple of 8")


class AllGatherGEMM:
    """out[m, n] = all_gather(a_shard)[m, k] @ b[k, n] (+ bias[n]); a_shard is [m / world, k] on every PE.

    Built once per (max_m, n, k, dtype) (collective), called on torch's current stream. `n` is this PE's column
    count (N / world in tensor parallelism). b may be row-major [k, n] or a transposed [n, k] weight (w.t()).
    mode: 'fused' (one overlapped kernel pair), 'decomposed' (all-gather, then GEMM on all SMs) or 'auto'
    (fused unless the GEMM is too small to hide anything). `chunk_rows` sets the signal granularity,
    `comm_blocks` the SMs given to communication.
    """

    def __init__(self, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *, mode: str = "auto",
                 chunk_rows: int | None = None, comm_blocks: int = 8):
        rt = self.rt = get_runtime()
        W = rt.world_size
        self.max_m, self.n, self.k = positive("max_m", max_m), positive("n", n), positive("k", k)
        check_dtype("AllGatherGEMM", dtype)
        check_k_n("AllGatherGEMM", k, n)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_m % W:
            raise ValueError(f"max_m = {max_m} must be a multiple of the world size {W}")
        self.dtype, self.mode = dtype, mode
        self._gemms = {lay: kgemm.CutlassGemm("ag_gemm", dtype, lay) for lay in kgemm.B_LAYOUTS}
        self.tile_m, self.tile_n = self._gemms["kn"].tile_shape
        ms = max_m // W
        if chunk_rows is None:  # about four chunks per shard, in whole tiles
            quarter = -(-ms // 4)
            chunk_rows = min(ms, -(-quarter // self.tile_m) * self.tile_m)
        self.ag = AllGather(ms, k, dtype, chunk_rows=chunk_rows, comm_blocks=positive("comm_blocks", comm_blocks))
        symmetric.agree("AllGatherGEMM(max_m, n, k, dtype, mode)", (max_m, n, k, str(dtype), mode))
        self.sms = torch.cuda.get_device_properties(rt.device).multi_processor_count
        cl = self._gemms["kn"].cluster_shape[0]
        self.gemm_sms = max(cl, (self.sms - self.ag.comm_blocks) // cl * cl)
        self.comm_stream = torch.cuda.Stream(device=rt.device)
        self._orders: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"AllGatherGEMM(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, mode={self.mode}, "
                f"world={self.rt.world_size}, node_size={self.rt.node_size}, tile={self.tile_m}x{self.tile_n}, "
                f"chunk_rows={self.ag.chunk_rows}, gemm_sms={self.gemm_sms}, comm_blocks={self.ag.comm_blocks})")

    def _fuse(self, m: int) -> bool:
        if self.mode != "auto":
            return self.mode == "fused"
        tiles = -(-m // self.tile_m) * -(-self.n // self.tile_n)
        return self.rt.world_size > 1 and tiles >= 2 * self.sms

    def _order(self, m: int) -> torch.Tensor:
        if m not in self._orders:
            rt = self.rt
            order = m_tile_order(ag_segment_order(rt.rank, rt.world_size, rt.node_size), m, m // rt.world_size,
                                 self.tile_m)
            self._orders[m] = torch.tensor(order, dtype=torch.int32, device=f"cuda:{rt.device}")
        return self._orders[m]

    def _gemm(self, layout: str, a_ptr: int, b: torch.Tensor, out: torch.Tensor, bias, m: int, *, wait: bool,
              sm_count: int, order: torch.Tensor | None) -> None:
        ag = self.ag
        ms = max(1, m // self.rt.world_size)
        args = kgemm.FsAgGemmArgs(
            m=m, n=self.n, k=self.k, a=a_ptr, b=b.data_ptr(), d=out.data_ptr(),
            bias=bias.data_ptr() if bias is not None else 0, sm_count=sm_count, device_id=self.rt.device,
            chunk_flags=ag.flags.data_ptr(), epoch=ag.sync.epoch.data_ptr(), rows_per_shard=ms,
            chunk_rows=ag.chunk_rows, chunks_per_shard=-(-ms // ag.chunk_rows), wait=int(wait),
            m_tile_order=order.data_ptr() if order is not None else 0, ctx=signals.ctx())
        self._gemms[layout].launch(args)

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 return_gathered: bool = False):
        signals.check_errors()
        rt = self.rt
        layout = check_operands("AllGatherGEMM", rt, a_shard, b, bias, self.dtype, self.k, self.n)
        ms = a_shard.shape[0]
        m = ms * rt.world_size
        if not 0 < m <= self.max_m:
            raise ValueError(f"a_shard has {ms} rows (M = {m}); this op takes M up to {self.max_m}")
        out = torch.empty((m, self.n), dtype=self.dtype, device=a_shard.device)
        main = torch.cuda.current_stream()
        ag = self.ag
        if self._fuse(m):
            self.comm_stream.wait_stream(main)
            ag.launch(a_shard, stream=self.comm_stream, wait_all=False)
            a_shard.record_stream(self.comm_stream)
            self._gemm(layout, ag.gather.data_ptr(), b, out, bias, m, wait=True, sm_count=self.gemm_sms,
                       order=self._order(m))
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
        rt = self.rt
        layout = check_operands("AllGatherGEMM.gemm_only", rt, a, b, bias, self.dtype, self.k, self.n)
        m = a.shape[0]
        if not 0 < m <= self.max_m:
            raise ValueError(f"a has {m} rows; this op takes M up to {self.max_m}")
        out = torch.empty((m, self.n), dtype=self.dtype, device=a.device)
        self._gemm(layout, a.data_ptr(), b, out, bias, m, wait=False, sm_count=self.sms, order=None)
        return out
