"""AllGather: out = all_gather(x, dim=0) over symmetric memory, chunk by chunk with one signal per chunk.

The same engine (csrc/collectives.cu fs_all_gather, walking the plan of `schedules.ag_plan`) feeds AllGatherGEMM;
here it runs alone. `launch_ce` is the copy-engine variant for one NVLink domain.
"""
from __future__ import annotations

import torch

from ..kernels import abi
from ..kernels.module import copy_async, load, write_value_async
from ..runtime import collective, pacing, signals, symmetric
from ..runtime.state import get_runtime
from ..plan.cache import PlanCache, plan_cache_capacity
from ..plan.schedules import ag_ce_copies, ag_plan, plan_tensors
from ._validate import capturing, check_dtype, check_tensor, not_capturing, positive

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)  # (the kernel moves bytes)


def default_chunk_rows(rows: int, cols: int, elem: int, world: int, blocks: int) -> int:
    """Chunks of at least 64 KiB, enough of them that every communication block has work."""
    per_shard = max(1, -(-blocks // max(world, 1)))
    rows_for_64k = max(1, (64 * 1024) // max(cols * elem, 1))
    return max(rows_for_64k, -(-rows // per_shard), 1)


def ce_capable(rt) -> bool:
    """The copy-engine path needs every PE load/store-reachable: one NVLink domain, no forced puts."""
    return rt.node_size == rt.world_size and all(rt.is_reachable(p) for p in range(rt.world_size))


class AllGather:
    """Gathers equal row shards of every PE: x [rows, cols] on each PE -> [world * rows, cols], PE order.

    Built once for shards of up to `max_rows` rows (collective: allocates symmetric buffers), then called like a
    function on torch's current stream. `chunk_rows` sets the signal granularity; `comm_blocks` how many thread
    blocks move data. `copy_engine=True` also allocates the flags of the copy-engine path (`launch_ce`).
    `chunk_major=True` sends chunk by chunk to every PE instead of PE by PE (`schedules.ag_units`), for consumers
    that wait for chunk c of every shard at once.
    """

    def __init__(self, max_rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, *,
                 chunk_rows: int | None = None, comm_blocks: int = 16, copy_engine: bool = False,
                 chunk_major: bool = False):
        with collective.all_or_none("AllGather construction"):  # an error on one PE reaches every PE
            self._construct(max_rows, cols, dtype, chunk_rows, comm_blocks, copy_engine, bool(chunk_major))

    def _construct(self, max_rows, cols, dtype, chunk_rows, comm_blocks, copy_engine, chunk_major) -> None:
        self.rt = get_runtime()
        self.max_rows, self.cols = positive("max_rows", max_rows), positive("cols", cols)
        check_dtype("AllGather", dtype, _DTYPES)
        self.dtype, self.comm_blocks = dtype, positive("comm_blocks", comm_blocks)
        elem = torch.empty((), dtype=dtype).element_size()
        self.chunk_rows = positive("chunk_rows", chunk_rows) if chunk_rows is not None else \
            default_chunk_rows(max_rows, cols, elem, self.rt.world_size, comm_blocks)
        self.chunk_major = chunk_major
        symmetric.agree("AllGather(max_rows, cols, dtype, chunk_rows, comm_blocks, copy_engine, chunk_major)",
                        (self.max_rows, self.cols, str(dtype), self.chunk_rows, self.comm_blocks, copy_engine,
                         chunk_major))
        W = self.rt.world_size
        self.max_chunks = -(-self.max_rows // self.chunk_rows)
        self.gather = symmetric.empty((W * self.max_rows, self.cols), dtype)
        self.flags = symmetric.zeros((W * self.max_chunks,), torch.int64)
        # Raised by the puts from other nodes; this PE's kernel accepts each (NVSHMEM's wait) and raises its flag.
        self.recv = symmetric.zeros((W * self.max_chunks,), torch.int64)
        # Copy-engine flags hold 1 (set by a write-value operation after the data) and are zeroed by their owner
        # at the end of each call; a separate array, so that the epoch values of the SM engine never satisfy them.
        self.ce_flags = symmetric.zeros((W * self.max_chunks,), torch.int64) if copy_engine else None
        self.one = torch.ones(1, dtype=torch.int64, device=f"cuda:{self.rt.device}")  # the CE flags' target
        # Recorded after launch_ce's barrier kernel: a consumer that spins on the CE flags waits for it first, so
        # it never holds SMs the barrier kernel still needs (the copies after it need none).
        self.ce_barrier_done = torch.cuda.Event()
        self.sync = signals.SyncState(self.rt)
        self._kernel = load("collectives").kernel("fs_all_gather")
        # [started blocks, all started]: see launch(gate=True)
        self._gate = torch.zeros(2, dtype=torch.int64, device=f"cuda:{self.rt.device}")
        # device tables per (rows, blocks, cluster), bounded like the fused ops' plans (alike on every PE: filled
        # by calls, pinned by prepare and capture)
        self._plans = PlanCache(plan_cache_capacity())
        self._peers: list[tuple[int, int]] | None = None  # (gather, ce_flags) addresses per PE, for launch_ce
        self.pace = pacing.pace(self.rt.device)

    @property
    def ce_capable(self) -> bool:
        return ce_capable(self.rt)

    def plan(self, rows: int, blocks: int, cluster: int = 1, *, pin: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Device tables of `ag_plan` for shards of `rows` rows on `blocks` blocks (cached, bounded): (units,
        offsets, blocks that have work, rounded up to a multiple of `cluster`). pin: kept for the op's life
        (prepare; so are tables used inside a CUDA-graph capture)."""
        def make():
            not_capturing(f"{type(self).__name__} with {rows} rows")
            rt = self.rt
            chunks = -(-rows // self.chunk_rows)
            return plan_tensors(ag_plan(rt.rank, rt.world_size, rt.node_size, chunks, blocks, self.chunk_major),
                                f"cuda:{rt.device}",
                                multiple=cluster)
        return self._plans.entry((rows, blocks, cluster), make, pin=pin, capturing=capturing())

    def peers(self) -> list[tuple[int, int]]:
        """(gather, ce_flags) addresses of every PE's buffers, for launch_ce (made once, before any capture)."""
        if self._peers is None:
            not_capturing("the copy-engine all-gather")
            self._peers = [(symmetric.peer(self.gather, p).data_ptr(), symmetric.peer(self.ce_flags, p).data_ptr())
                           for p in range(self.rt.world_size)]
        return self._peers

    def launch_ce(self, x: torch.Tensor, stream) -> torch.Tensor:
        """Copy-engine variant of `launch(x, stream, wait_all=False)`, for one NVLink domain: after a barrier
        (every PE is past its previous call; one block), each chunk of x is copied by DMA into every PE's gather
        buffer in the order of `ag_ce_copies`, each followed by a write-value operation that sets the chunk's flag
        on that PE to 1. A write-value operation is preceded by a memory barrier for all prior work of its stream
        (cuStreamWriteValue64 without CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER), so a peer that sees the flag sees
        the data; its value is a constant, so CUDA-graph replays stay correct, and `ce_done` zeroes the flags
        again. No SM moves data, so the GEMM beside it keeps all but the barrier's SMs."""
        rt = self.rt
        if not self.ce_capable:
            raise ValueError("the copy-engine all-gather needs every PE in one NVLink domain (one node, no "
                             "FLUX_SHMEM_FORCE_PUT): use engine='sm'")
        if self.ce_flags is None:
            raise ValueError("this AllGather was built without copy_engine=True")
        W, me = rt.world_size, rt.rank
        peers = self.peers()
        self.sync.barrier(stream)
        self.ce_barrier_done.record(stream)
        rows = x.shape[0]
        src = x.data_ptr()
        for cp in ag_ce_copies(me, W, rows, self.chunk_rows, self.cols * x.element_size()):
            gather, flags = peers[cp.dest]
            copy_async(gather + cp.offset, src + cp.src_offset, cp.nbytes, stream)
            write_value_async(flags + 8 * cp.flag, 1, stream)
        return self.gather[: W * rows]

    def ce_done(self, stream) -> None:
        """After this PE's consumer of a `launch_ce` call: zero its copy-engine flags for the next call (peers
        write them again only after this PE's next barrier arrival, which follows on the same stream)."""
        with torch.cuda.stream(stream):
            self.ce_flags.zero_()

    def __repr__(self) -> str:
        return (f"AllGather(max_rows={self.max_rows}, cols={self.cols}, dtype={self.dtype}, world="
                f"{self.rt.world_size}, chunk_rows={self.chunk_rows}, node_size={self.rt.node_size})")

    def launch(self, x: torch.Tensor, stream=None, *, wait_all: bool = True, blocks: int | None = None,
               gate: bool = False, cluster: int = 1) -> torch.Tensor:
        """Gather x on `stream` into the internal symmetric buffer (returned), on `blocks` thread blocks (default
        comm_blocks). wait_all=False: the kernel ends once this PE's data is sent; consumers then wait on `flags`
        themselves (the fused GEMM does). gate=True: the kernel's last block to start raises a flag that
        `wait_started` holds another stream on. cluster=c launches the blocks in clusters of c (idle blocks
        fill the last): beside a GEMM of clusters of c, single blocks spread over the GPCs would leave SMs that
        no GEMM cluster can use, and the GEMM's last clusters would wait for the gather kernel to end (seen
        2026-12-04 in a green context of 64 SMs: AG+GEMM 8192x2560x8192 ran as comm + GEMM, serialized)."""
        rows = x.shape[0]
        elem = x.element_size()
        chunks = -(-rows // self.chunk_rows)
        units, offsets, grid = self.plan(rows, blocks or self.comm_blocks, cluster)
        me = self.rt.rank
        slot = self.gather[me * rows:(me + 1) * rows]
        if x.data_ptr() != slot.data_ptr():
            # My own rows go into my gather buffer by the copy engine (no SM; ~1.5 TB/s): the kernel then only
            # raises their flags and sends from there. (Only I write my slot; my previous call's readers of this
            # buffer are behind on this stream.)
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                slot.copy_(x)
            x = slot
        args = abi.AgArgs(ctx=signals.ctx(), src=x.data_ptr(), gather=self.gather.data_ptr(),
                          flags=self.flags.data_ptr(), recv=self.recv.data_ptr(), bar=self.sync.bar.data_ptr(),
                          epoch=self.sync.epoch.data_ptr(), units=units.data_ptr(), block_begin=offsets.data_ptr(),
                          shard_bytes=rows * self.cols * elem, chunk_bytes=self.chunk_rows * self.cols * elem,
                          chunks=chunks, node_size=self.rt.node_size, wait_all=int(wait_all), pace=self.pace,
                          started=self._gate.data_ptr() if gate else 0)
        self._kernel.launch(args, grid, 512, stream=stream, cluster=(cluster, 1, 1) if cluster > 1 else None)
        return self.gather[: self.rt.world_size * rows]

    def wait_started(self, stream) -> None:
        """Hold `stream` until every block of the last `launch(gate=True)` is running, then re-arm the gate. A GEMM
        launched after this, which spins on chunk flags, can never hold SMs that this PE's gather kernel still
        waits for. Unlike CUDA's launch-completion event (best effort, and under MPS not seen to hold anything
        back) it is the kernel's own blocks that open it. The wait is a one-block kernel with the runtime's
        timeout, which reports this PE and the gate if the gather blocks never all start (a stream memop wait
        would hang silently); the re-arm is a memop. Both graph-capturable."""
        flag = self._gate.data_ptr() + 8
        args = abi.WaitArgs(ctx=signals.ctx(), sig=flag, expected=1, site=6, index=0)
        load("collectives").kernel("fs_wait_signal").launch(args, 1, 32, stream=stream)
        write_value_async(flag, 0, stream)

    def wait_chunk(self, rows: int, chunk: int, stream) -> None:
        """Hold `stream` until chunk `chunk` of every PE's shard (shards of `rows` rows) of the running
        `launch(wait_all=False)` is here, for consumers that are not our GEMMs (those wait per tile themselves).
        One block, a thread per PE (csrc fs_wait_flags), each wait with the runtime's timeout naming its flag."""
        W = self.rt.world_size
        args = abi.WaitFlagsArgs(ctx=signals.ctx(), flags=self.flags.data_ptr(), target=self.sync.epoch.data_ptr(),
                                 first=chunk, stride=-(-rows // self.chunk_rows), count=W, site=2)
        load("collectives").kernel("fs_wait_flags").launch(args, 1, max(32, min(1024, -(-W // 32) * 32)),
                                                           stream=stream)

    def check(self, x: torch.Tensor) -> None:
        check_tensor("x", x, dtype=self.dtype, device=self.rt.device)
        if x.shape[1] != self.cols:
            raise ValueError(f"x has {x.shape[1]} columns, the op was built for {self.cols}")
        if not 0 < x.shape[0] <= self.max_rows:
            raise ValueError(f"x has {x.shape[0]} rows; this op takes 1..{self.max_rows} (build it with a larger "
                             "max_rows)")

    def __call__(self, x: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
        """x: [rows, cols] -> [world * rows, cols]. copy=False returns a view of the internal buffer, valid until
        the next call of this op."""
        signals.check_errors()
        self.check(x)
        out = self.launch(x)
        self.sync.bump()
        return out.clone() if copy else out
