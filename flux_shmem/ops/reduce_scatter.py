"""ReduceScatter: out = reduce_scatter(x, dim=0) (sum) over symmetric memory, in fp32, deterministic order.

Inside a node, each PE pulls its rows from its peers by NVLink loads; across nodes, node partial sums travel by
NVSHMEM put-with-signal to the PE with the same local index, which adds them in node order. The same engine
(fs_reduce_scatter_*, walking the plan of `schedules.rs_plan`) finishes GEMMReduceScatter.
"""
from __future__ import annotations

import os

import torch

from ..kernels import abi
from ..kernels.module import load
from ..plan.cache import PlanCache, plan_cache_capacity
from ..runtime import collective, pacing, signals, symmetric
from ..runtime.state import Runtime, get_runtime
from ..plan.schedules import (chunk_completion, default_unit_rows, plan_tensors, rs_completion, rs_max_units,
                              rs_plan, rs_split_tail, rs_tile_order, rs_units)
from ._validate import capturing, check_dtype, check_tensor, not_capturing, positive

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}



def _switch(name: str) -> bool:
    v = os.environ.get(name, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return v == "1"


def done_protocol() -> bool:
    """$FLUX_SHMEM_RS_DONE=1 (off until measured): GEMMReduceScatter calls start with `ReduceEngine.wait_done`
    (every node peer finished reading my previous addend: a flag its last call set) instead of a barrier of every
    PE, and every call ends with the done signal. At small M, where each call is host-bound, the barrier made
    every PE wait for the slowest PE's launches: the decomposed path ran 40-95 us behind cuBLAS + our
    ReduceScatter (whose kernel waits only for its node peers' arrival) at M <= 2048 (2026-12-07, H100, 2 and 4
    PEs under MPS)."""
    return _switch("FLUX_SHMEM_RS_DONE")


def kernel_flags(dtype: torch.dtype) -> int:
    """Experiments against the fused GEMM's slowdown beside the reduce kernel (1.07-1.21x on an H100, 2026-12-05),
    off by default until measured: $FLUX_SHMEM_RS_EVICT_FIRST=1, the sums' loads and stores (16-bit types) carry
    an L2 evict-first policy, so partials streamed through once leave L2 to the GEMM; $FLUX_SHMEM_RS_POLL_SLEEP=1,
    waits for GEMM tiles sleep between polls."""
    flags = abi.RS_EVICT_FIRST if _switch("FLUX_SHMEM_RS_EVICT_FIRST") and dtype != torch.float32 else 0
    return flags | (abi.RS_POLL_SLEEP if _switch("FLUX_SHMEM_RS_POLL_SLEEP") else 0)

class ReduceEngine:
    """Buffers and launch of the reduce-scatter kernel, shared by ReduceScatter and GEMMReduceScatter.

    The addend is written in tiles of tile_m x tile_n (GEMMReduceScatter: its GEMM's tiles, walked by clusters of
    cluster_m CTAs; the standalone op: unit_rows x cols, copied by the kernel itself), each marked ready in
    `tile_ready`; a call's units (`schedules.RsUnits`: unit_rows rows x group_tiles N-tiles) wait for the tiles
    under them."""

    def __init__(self, rt: Runtime, max_rows: int, cols: int, dtype: torch.dtype, *, unit_rows: int,
                 tile_m: int, comm_blocks: int, tile_n: int | None = None, cluster_m: int = 1):
        W, L = rt.world_size, rt.node_size
        if tile_m % unit_rows:
            raise ValueError(f"unit_rows={unit_rows} must divide the tile height {tile_m}")
        if unit_rows * cols >= 2 ** 31:
            raise ValueError(f"unit_rows={unit_rows} x cols={cols} is too large for one unit: lower unit_rows")
        self.rt, self.cols, self.dtype = rt, cols, dtype
        self.unit_rows, self.tile_m, self.comm_blocks = unit_rows, tile_m, comm_blocks
        self.tile_n, self.cluster_m = tile_n or cols, cluster_m
        self.tiles_n = -(-cols // self.tile_n)
        self.nodes = W // L
        max_seg = -(-max_rows // W)
        self.max_units = rs_max_units(max_seg, unit_rows, self.tiles_n)  # (at most tiles_n column groups)
        self.partial = symmetric.empty((max_rows, cols), dtype)
        two_level = self.nodes > 1
        # Node partials only exist with more than one node; keep the allocations symmetric either way.
        self.stage = symmetric.empty((self.nodes * max_seg if two_level else 1, cols), dtype)
        self.recv = symmetric.empty((self.nodes * max_seg if two_level else 1, cols), dtype)
        self.recv_sig = symmetric.zeros((self.nodes * self.max_units,), torch.int64)
        self.max_tiles_m = -(-max_rows // tile_m)
        self.tile_ready = symmetric.zeros((self.max_tiles_m * self.tiles_n,), torch.int64)
        self.done = symmetric.zeros((W,), torch.int64)
        self.sync = signals.SyncState(rt)
        dev = f"cuda:{rt.device}"
        self.seen = torch.zeros((W * self.tile_ready.numel(),), dtype=torch.int64, device=dev)
        self.exits = torch.zeros(2, dtype=torch.int64, device=dev)
        self._kernel = load("collectives").kernel(f"fs_reduce_scatter_{_DTYPES[dtype]}")
        self._wait_done = load("collectives").kernel("fs_wait_done")
        # device tables per call shape, bounded like the fused ops' plans (alike on every PE: filled by calls,
        # pinned by prepare and capture)
        self._plans = PlanCache(plan_cache_capacity())
        self.pace = pacing.pace(rt.device)
        self.kernel_flags = kernel_flags(dtype)

    def plan(self, rows: int, blocks: int, standalone: bool, swizzle: int = 1, group_tiles: int | None = None,
             tail: int = 0, tail_blocks: int = 0, *, chunk_rows: int | None = None, pin: bool = False) -> tuple:
        """Device tables of `rs_plan` for `rows` rows on `blocks` blocks, its units `group_tiles` N-tiles wide (None:
        whole rows) in the order a GEMM with `swizzle` completes them (cached), and of its tail (the last `tail`
        pieces that GEMM completes, on `tail_blocks` blocks; None without one): each (items, offsets, blocks that
        have work); and the units. chunk_rows: the addend is written in steps of chunk_rows rows of every segment
        (`schedules.chunk_step_of_tiles`, whole rows), and the units follow them. Bounded like the plans; pin: kept
        for the op's life (prepare, capture)."""
        def make():
            not_capturing(f"{type(self).__name__} with {rows} rows")
            rt = self.rt
            W, L = rt.world_size, rt.node_size
            units = rs_units(rows // W, self.unit_rows, self.tile_m, self.cols, self.tile_n, group_tiles)
            if chunk_rows is not None:
                completion = chunk_completion(rows, rows // W, chunk_rows, self.tile_m)
            else:
                completion = rs_completion(rs_tile_order(rt.rank, W, L, rows, self.tile_m), self.tiles_n,
                                           self.cluster_m, swizzle, units.group_tiles)
            per_block = rs_plan(rt.rank, W, L, rows, units, blocks, copy_rows=rows if standalone else 0,
                                completion=completion)
            main, tail_plan = rs_split_tail(per_block, completion, tail, units, max(1, tail_blocks))
            dev = f"cuda:{rt.device}"
            return plan_tensors(main, dev), plan_tensors(tail_plan, dev) if tail_plan else None, units
        key = (rows, blocks, standalone, swizzle, group_tiles, tail, tail_blocks, chunk_rows)
        return self._plans.entry(key, make, pin=pin, capturing=capturing())

    def launch(self, rows: int, out: torch.Tensor, *, src: torch.Tensor | None, bias: torch.Tensor | None,
               stream=None, blocks: int | None = None, swizzle: int = 1, group_tiles: int | None = None,
               tail: int = 0, tail_blocks: int = 0, part: str = "main", chunk_rows: int | None = None,
               signal_done: bool = False) -> None:
        """Launch the reduce kernel's `part` of the plan: 'main' (everything, or everything but the tail) or
        'tail' (after the GEMM). A standalone call (src given), or signal_done=True (the call's only reduce
        launch), signals 'done reading' for `wait_done`. chunk_rows: the addend comes in chunk steps (`plan`)."""
        W, L = self.rt.world_size, self.rt.node_size
        main, tail_plan, units = self.plan(rows, blocks or self.comm_blocks, src is not None, swizzle, group_tiles,
                                           tail, tail_blocks, chunk_rows=chunk_rows)
        if part == "tail" and tail_plan is None:
            return
        items, offsets, grid = main if part == "main" else tail_plan
        args = abi.RsArgs(ctx=signals.ctx(), src=src.data_ptr() if src is not None else 0,
                          partial=self.partial.data_ptr(), stage=self.stage.data_ptr(), recv=self.recv.data_ptr(),
                          recv_sig=self.recv_sig.data_ptr(), out=out.data_ptr(),
                          bias=bias.data_ptr() if bias is not None else 0,
                          tile_ready=self.tile_ready.data_ptr(), seen=self.seen.data_ptr(),
                          bar=self.sync.bar.data_ptr(), done=self.done.data_ptr(), exits=self.exits.data_ptr(),
                          epoch=self.sync.epoch.data_ptr(), items=items.data_ptr(), block_begin=offsets.data_ptr(),
                          m=rows, n=self.cols, rows_per_shard=rows // W, tile_m=self.tile_m, tile_n=self.tile_n,
                          tiles_n=self.tiles_n, group_tiles=units.group_tiles, unit_rows=self.unit_rows,
                          node_size=L, max_tiles_m=self.max_tiles_m, max_units=self.max_units,
                          flags=(abi.RS_SIGNAL_DONE if src is not None or signal_done else 0) | self.kernel_flags,
                          pace=self.pace)
        # Dynamic shared memory: the node peers' addend pointers (no cap on the node size).
        self._kernel.launch(args, grid, 512, smem=8 * L, stream=stream)

    def wait_done(self, stream=None) -> None:
        """Make `stream` wait until every PE of this node has finished reading this PE's previous input."""
        self._wait_done.launch(self._done_args(), 1, 32, stream=stream)

    def signal_done(self, stream=None) -> None:
        """After every reduce launch of this call on `stream`: tell my node's PEs I no longer read their addends
        (what a launch with signal_done=True does from its last block)."""
        load("collectives").kernel("fs_signal_done").launch(self._done_args(), 1, 32, stream=stream)

    def _done_args(self) -> abi.WaitDoneArgs:
        return abi.WaitDoneArgs(ctx=signals.ctx(), done=self.done.data_ptr(), epoch=self.sync.epoch.data_ptr(),
                                node_size=self.rt.node_size)


class ReduceScatter:
    """Sums x over PEs and scatters row segments: x [rows, cols] on each PE -> [rows // world, cols] on PE r,
    rows [r*rows/world, (r+1)*rows/world) of the sum. Optional bias [cols] is added once.

    Built once for up to `max_rows` rows (collective), called like a function on torch's current stream.
    """

    def __init__(self, max_rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, *,
                 unit_rows: int | None = None, comm_blocks: int = 16):
        with collective.all_or_none("ReduceScatter construction"):  # an error on one PE reaches every PE
            self._construct(max_rows, cols, dtype, unit_rows, comm_blocks)

    def _construct(self, max_rows, cols, dtype, unit_rows, comm_blocks) -> None:
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
        """The symmetric input buffer, [rows, cols]: write x here (on the current stream, after this call) and pass
        it to the op to skip the copy of a private tensor. This call first makes the current stream wait until
        every node peer has finished reading the previous call's input from it, so the writes cannot reach a
        peer that is still summing (graph-capturable)."""
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"rows={rows}: this op takes 1..{self.max_rows}")
        self.engine.wait_done()
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
        self.engine.launch(rows, out, src=x, bias=bias)
        self.engine.sync.bump()
        return out
