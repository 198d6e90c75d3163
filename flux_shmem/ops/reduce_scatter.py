"""ReduceScatter: out = reduce_scatter(x, dim=0) (sum) over symmetric memory, in fp32, deterministic order.

Inside a node, each PE pulls its rows from its peers by NVLink loads; across nodes, node partial sums travel by
NVSHMEM put-with-signal to the PE with the same local index, which adds them in node order. The same engine
(fs_reduce_scatter_*) finishes GEMMReduceScatter.
"""
from __future__ import annotations

import torch

from ..kernels import abi
from ..kernels.module import load
from ..runtime import signals, symmetric
from ..runtime.bootstrap import Runtime, get_runtime
from ._validate import check_dtype, check_tensor, positive

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def default_unit_rows(cols: int, elem: int, tile_m: int = 128) -> int:
    """Rows per unit of work: a power of two dividing tile_m, about 128 KiB of one addend."""
    rows = 1
    while rows < tile_m and rows * 2 * cols * elem <= 128 * 1024:
        rows *= 2
    return rows


class ReduceEngine:
    """Buffers and launch of the reduce-scatter kernel, shared by ReduceScatter and GEMMReduceScatter."""

    def __init__(self, rt: Runtime, max_rows: int, cols: int, dtype: torch.dtype, *, unit_rows: int,
                 tile_m: int, comm_blocks: int):
        W, L = rt.world_size, rt.node_size
        if tile_m % unit_rows:
            raise ValueError(f"unit_rows={unit_rows} must divide the tile height {tile_m}")
        self.rt, self.cols, self.dtype = rt, cols, dtype
        self.unit_rows, self.tile_m, self.comm_blocks = unit_rows, tile_m, comm_blocks
        self.nodes = W // L
        max_seg = -(-max_rows // W)
        self.max_units = max_seg // unit_rows + 2
        self.partial = symmetric.empty((max_rows, cols), dtype)
        two_level = self.nodes > 1
        # Node partials only exist with more than one node; keep the allocations symmetric either way.
        self.stage = symmetric.empty((self.nodes * max_seg if two_level else 1, cols), dtype)
        self.recv = symmetric.empty((self.nodes * max_seg if two_level else 1, cols), dtype)
        self.recv_sig = symmetric.zeros((self.nodes * self.max_units,), torch.int64)
        self.rows_ready = symmetric.zeros((-(-max_rows // tile_m),), torch.int64)
        self.sync = signals.SyncState(rt)
        self._kernel = load("collectives").kernel(f"fs_reduce_scatter_{_DTYPES[dtype]}")

    def launch(self, rows: int, out: torch.Tensor, *, src: torch.Tensor | None, bias: torch.Tensor | None,
               tiles_n: int, stream=None) -> None:
        W = self.rt.world_size
        args = abi.RsArgs(ctx=signals.ctx(), src=src.data_ptr() if src is not None else 0,
                          partial=self.partial.data_ptr(), stage=self.stage.data_ptr(), recv=self.recv.data_ptr(),
                          recv_sig=self.recv_sig.data_ptr(), out=out.data_ptr(),
                          bias=bias.data_ptr() if bias is not None else 0, rows_ready=self.rows_ready.data_ptr(),
                          bar=self.sync.bar.data_ptr(), epoch=self.sync.epoch.data_ptr(), m=rows, n=self.cols,
                          rows_per_shard=rows // W, tile_m=self.tile_m, tiles_n=tiles_n, unit_rows=self.unit_rows,
                          node_size=self.rt.node_size, max_tiles_m=self.rows_ready.numel())
        self._kernel.launch(args, self.comm_blocks, 512, stream=stream)


class ReduceScatter:
    """Sums x over PEs and scatters row segments: x [rows, cols] on each PE -> [rows // world, cols] on PE r,
    rows [r*rows/world, (r+1)*rows/world) of the sum. Optional bias [cols] is added once.

    Built once for up to `max_rows` rows (collective), called like a function on torch's current stream.
    """

    def __init__(self, max_rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, *,
                 unit_rows: int | None = None, comm_blocks: int = 16):
        rt = self.rt = get_runtime()
        self.max_rows, self.cols = positive("max_rows", max_rows), positive("cols", cols)
        check_dtype("ReduceScatter", dtype, tuple(_DTYPES))
        elem = torch.empty((), dtype=dtype).element_size()
        if (cols * elem) % 16:
            raise ValueError(f"ReduceScatter needs rows of a multiple of 16 bytes (cols={cols} of {dtype}): pad "
                             f"cols to a multiple of {16 // elem}")
        self.dtype = dtype
        unit_rows = positive("unit_rows", unit_rows) if unit_rows is not None else default_unit_rows(cols, elem)
        symmetric.agree("ReduceScatter(max_rows, cols, dtype, unit_rows, comm_blocks)",
                        (self.max_rows, cols, str(dtype), unit_rows, comm_blocks))
        self.engine = ReduceEngine(rt, max_rows, cols, dtype, unit_rows=unit_rows, tile_m=unit_rows,
                                   comm_blocks=positive("comm_blocks", comm_blocks))

    def __repr__(self) -> str:
        return (f"ReduceScatter(max_rows={self.max_rows}, cols={self.cols}, dtype={self.dtype}, world="
                f"{self.rt.world_size}, unit_rows={self.engine.unit_rows}, node_size={self.rt.node_size})")

    def input_buffer(self, rows: int) -> torch.Tensor:
        """The symmetric input buffer, [rows, cols]: write x here to skip the copy of a private tensor."""
        return self.engine.partial[:rows]

    def __call__(self, x: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
        signals.check_errors()
        rt = self.rt
        check_tensor("x", x, dtype=self.dtype, device=rt.device)
        rows = x.shape[0]
        if x.shape[1] != self.cols:
            raise ValueError(f"x has {x.shape[1]} columns, the op was built for {self.cols}")
        if not 0 < rows <= self.max_rows or rows % rt.world_size:
            raise ValueError(f"x has {rows} rows; this op takes a multiple of the world size {rt.world_size} up to "
                             f"{self.max_rows}")
        if bias is not None:
            check_tensor("bias", bias, dtype=self.dtype, device=rt.device, ndim=1)
            if bias.shape[0] != self.cols:
                raise ValueError(f"bias has {bias.shape[0]} entries, expected {self.cols}")
        out = torch.empty((rows // rt.world_size, self.cols), dtype=self.dtype, device=x.device)
        self.engine.launch(rows, out, src=x, bias=bias, tiles_n=1)
        self.engine.sync.bump()
        return out
