"""What AllGatherGEMM and GEMMReduceScatter share: argument checks, their CUTLASS kernels, SM split, tile orders."""
from __future__ import annotations

from typing import Callable

import torch

from ..kernels import gemm as kgemm
from ..runtime.bootstrap import get_runtime
from ._schedule import m_tile_order
from ._validate import check_dtype, check_tensor, positive

MODES = ("auto", "fused", "decomposed")


def b_layout_of(b: torch.Tensor) -> str:
    """'kn' for a row-major [K, N] b, 'nk' for the transpose of a row-major [N, K] weight (b = w.t())."""
    if b.is_contiguous():
        return "kn"
    if b.t().is_contiguous():
        return "nk"
    raise ValueError("b must be row-major [K, N] or the transpose of a row-major [N, K] tensor (w.t()): pass "
                     "b.contiguous()")


class FusedGEMM:
    """Base of the fused ops: validated dimensions, one CUTLASS kernel per B layout, the SMs left to the GEMM when a
    communication kernel runs beside it, and the per-M tile-order tables."""

    family = ""
    segment_order: Callable[[int, int, int], list[int]]

    def __init__(self, max_m: int, n: int, k: int, dtype: torch.dtype, mode: str, comm_blocks: int):
        rt = self.rt = get_runtime()
        name = type(self).__name__
        self.max_m, self.n, self.k = positive("max_m", max_m), positive("n", n), positive("k", k)
        check_dtype(name, dtype)
        for what, v in (("K", k), ("N", n)):  # TMA needs 16-byte aligned rows
            if v % 8:
                raise ValueError(f"{name}: {what} = {v} is not a multiple of 8 (TMA needs 16-byte rows); pad "
                                 f"{what} to a multiple of 8")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_m % rt.world_size:
            raise ValueError(f"max_m = {max_m} must be a multiple of the world size {rt.world_size}")
        self.dtype, self.mode = dtype, mode
        self._gemms = {lay: kgemm.CutlassGemm(self.family, dtype, lay) for lay in kgemm.B_LAYOUTS}
        self.tile_m, self.tile_n = self._gemms["kn"].tile_shape
        self.sms = torch.cuda.get_device_properties(rt.device).multi_processor_count
        cluster_m = self._gemms["kn"].cluster_shape[0]
        self.gemm_sms = max(cluster_m, (self.sms - positive("comm_blocks", comm_blocks)) // cluster_m * cluster_m)
        self.comm_stream = torch.cuda.Stream(device=rt.device)
        self._orders: dict[int, torch.Tensor] = {}

    def path(self, m: int) -> str:
        """'fused' or 'decomposed' (or 'gemm' with one PE, where there is nothing to communicate): what a call
        with M = m runs ('auto' fuses when the GEMM has at least two waves of tiles to hide communication behind)."""
        if self.rt.world_size == 1:
            return "gemm"
        if self.mode != "auto":
            return self.mode
        tiles = -(-m // self.tile_m) * -(-self.n // self.tile_n)
        return "fused" if tiles >= 2 * self.sms else "decomposed"

    def swizzle(self, m: int, fused: bool) -> int:
        """Scheduler swizzle for M = m; fused calls keep each group of M-tiles inside one shard (segment)."""
        shard_tiles = -(-(m // self.rt.world_size) // self.tile_m) if fused else None
        return self._gemms["kn"].swizzle(m, shard_tiles)

    def order(self, m: int) -> torch.Tensor:
        """Device table of M-tiles in this PE's visiting order for M = m (cached per m)."""
        if m not in self._orders:
            rt = self.rt
            segs = type(self).segment_order(rt.rank, rt.world_size, rt.node_size)
            self._orders[m] = torch.tensor(m_tile_order(segs, m, m // rt.world_size, self.tile_m),
                                           dtype=torch.int32, device=f"cuda:{rt.device}")
        return self._orders[m]

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
            check_tensor("bias", bias, dtype=self.dtype, device=rt.device, ndim=1)
            if bias.shape[0] != n:
                raise ValueError(f"bias has {bias.shape[0]} entries, expected N = {n}")
        return b_layout_of(b)
