"""Mixture-of-experts ops for tensor-parallel experts (issue 38): every PE holds a shard of every expert's weights
(the up projection split by columns, the down projection by rows) and the tokens are sharded by rows.

    AllGatherGroupGEMM     y = grouped_mm(all_gather(x)[routing.rows], w1[e]) per expert e: [M * topk, inter]
    GroupGEMMReduceScatter out = reduce_scatter(combine(grouped_mm(h, w2[e]), weights)): [M / world, hidden]

The rows of y and h are the (token, slot) pairs grouped expert by expert (`plan.moe.route`); the first op returns
that `Routing` and the second takes it back, so a Mixtral-style block is

    y, r = ag(x, topk_ids, w_up, topk_weights=w)     # x: this PE's tokens, ids / weights: its router's top-k
    out = rs(act(y), w_down, r)                      # this PE's tokens again

Two paths run today. 'decomposed': our AllGather (tokens, and the ids with the weights in one small gather),
torch's grouped GEMM (`torch._grouped_mm`, CUTLASS grouped kernels on sm90), the top-k combine in fp32, our
ReduceScatter. 'pipelined': the same kernels overlapped chunk by chunk. The rows come in blocks (`Routing`: block
s = the pairs of tokens [s c, (s + 1) c) of every PE's shard, expert by expert), and one grouped GEMM per block
runs on the current stream while our comm kernels move the other blocks on a side stream: the all-gather sends
chunk by chunk (`chunk_major`) and block s waits only for chunk s of every shard (`AllGather.wait_chunk`); the down
projection combines block s into its rows of the reduce-scatter's symmetric addend, marks those tiles, and the
reduce kernel sums each unit once every PE of the node has marked it. The fused grouped kernel (tiles that wait
only on the chunks they read: `plan.moe.tile_waits`) is the next step of issue 38; mode='fused' says so.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..plan import moe as pmoe
from ..plan.schedules import chunk_step_of_tiles
from ..runtime import collective, partition, signals, symmetric
from ..runtime.sm_budget import sm_budget
from ..runtime.state import get_runtime
from ._validate import check_tensor, not_capturing, positive
from .all_gather import AllGather
from .reduce_scatter import ReduceScatter

E4M3 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, E4M3)  # torch._grouped_mm's CUDA kernels take bf16; e4m3: torch._scaled_grouped_mm
LAYOUTS = ("nk", "kn")       # expert weights [E, N, K] (as nn.Linear stores them) or [E, K, N]
PARALLEL = ("tp", "ep")      # every PE a shard of every expert, or whole experts: num_experts / world each
MODES = ("auto", "decomposed", "pipelined", "fused")
# blocks of a full shard in mode 'pipelined' (a shard of fewer rows has fewer); FLUX_SHMEM_MOE_STEPS overrides it
PIPELINE_STEPS = int(os.environ.get("FLUX_SHMEM_MOE_STEPS", "4"))


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, layout: str) -> torch.Tensor:
    """a [R, K] (rows grouped by expert, expert e's ending at offs[e]) times each expert's weight -> [R, N]:
    w [E, N, K] ('nk') or [E, K, N] ('kn')."""
    b = w.transpose(-2, -1) if layout == "nk" else w
    return torch._grouped_mm(a, b, offs=offs)


def slot_values(rows: torch.Tensor, inverse: torch.Tensor, local: Optional[torch.Tensor], topk: int) -> torch.Tensor:
    """Grouped rows [R, N] -> [len(inverse) / topk, topk, N] fp32, slot i reading row inverse[i]; `local` (bool
    [.., topk], expert parallel): 0 in the slots whose expert is on another PE (their rows hold garbage, perhaps
    NaN, so they are replaced, not weighted by 0)."""
    v = rows.index_select(0, inverse).view(-1, topk, rows.shape[1]).float()
    return v if local is None else torch.where(local[..., None], v, 0.0)


def by_slot(rows: torch.Tensor, routing: pmoe.Routing) -> torch.Tensor:
    """Grouped rows [M * topk, N] -> [M, topk, N] fp32 by (token, slot) (`slot_values` of the routing)."""
    return slot_values(rows, routing.inverse, routing.local, routing.topk)


def weighted_sum(slots: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, topk, N] fp32 slot values, [T, topk] router weights -> [T, N] in `dtype`: the top-k combine, in fp32, in
    slot order (deterministic: no atomics)."""
    return torch.einsum("tjn,tj->tn", slots, weights.float()).to(dtype)


def row_experts(routing: pmoe.Routing) -> torch.Tensor:
    """[M * topk] int64: the index of each grouped row's expert among the experts here (into w and bias), clamped
    (rows of other PEs' experts, or of ids out of range with check_ids=False, still index a real expert)."""
    e = routing.ids.reshape(-1).index_select(0, routing.perm) - routing.first_expert
    return e.clamp(0, routing.experts_here - 1)


def combine(partial: torch.Tensor, routing: pmoe.Routing, weights: torch.Tensor) -> torch.Tensor:
    """Each token's sum over its topk grouped rows, weighted by the router ([M, topk]) -> [M, N] in partial's dtype
    (`weighted_sum`; expert parallel: over the slots of this PE's experts)."""
    return weighted_sum(by_slot(partial, routing), weights, partial.dtype)


def combine_block(partial: torch.Tensor, routing: pmoe.Routing, weights: torch.Tensor, block: int) -> torch.Tensor:
    """`combine` of one block of a blocked routing: partial [block rows, N] (the block's grouped rows) -> [world,
    t1 - t0, N], the block's tokens of every PE's shard, PE by PE."""
    lo, _, t0, t1 = routing.blocks()[block]
    m, k = routing.shard_tokens, routing.topk
    world = routing.tokens // m
    idx = routing.inverse.view(world, m, k)[:, t0:t1].reshape(-1) - lo
    out = weighted_sum(slot_values(partial, idx, None, k), weights.view(world, m, k)[:, t0:t1].reshape(-1, k),
                       partial.dtype)
    return out.view(world, t1 - t0, -1)


def _check_choice(name: str, v, allowed) -> None:
    if v not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {v!r}")


def _check_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype == torch.float8_e5m2:
        raise TypeError(f"{op}: float8_e5m2 is not supported (the fp8 grouped GEMM takes float8_e4m3fn with "
                        "scales): cast to torch.float8_e4m3fn")
    if dtype not in DTYPES:
        raise TypeError(f"{op}: dtype {dtype} is not supported (torch's grouped GEMMs take bfloat16, or "
                        "float8_e4m3fn with scales): cast to torch.bfloat16")


def scaled_grouped_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      offs: torch.Tensor) -> torch.Tensor:
    """e4m3 a [R, K] (grouped rows, one fp32 scale per row) times each expert's e4m3 w [E, N, K] (fp32 scales
    [E, N]) -> bf16 [R, N]: a_scale[r] * w_scale[e, n] * (a @ w[e]^T). torch._scaled_grouped_mm on a GPU; on the
    CPU (tests only: the ops need a GPU) the same product dequantized in fp32."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, w.transpose(-2, -1), a_scale, w_scale, offs=offs,
                                        out_dtype=torch.bfloat16)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        if hi > lo:
            out[lo:hi] = (a[lo:hi].float() * a_scale[lo:hi, None]) @ (w[e].float() * w_scale[e][:, None]).t()
        lo = hi
    return out.to(torch.bfloat16)


def row_scales(name: str, scale, rows: int, device) -> torch.Tensor:
    """An fp32 scale per row from `scale`: [] (one for the tensor) or [rows]."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.device != device:
        raise TypeError(f"{name} must be a float32 tensor on {device} ([] per tensor or [{rows}] per row), got "
                        f"{type(scale).__name__ if not isinstance(scale, torch.Tensor) else scale.dtype}")
    if scale.dim() == 0 or tuple(scale.shape) == (1,):
        return scale.reshape(1).expand(rows).contiguous()
    if tuple(scale.shape) != (rows,):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}: expected [] (per tensor) or [{rows}] (per row)")
    return scale.contiguous()


def expert_scales(name: str, scale, experts: int, n: int, device) -> torch.Tensor:
    """An fp32 scale per (expert, output column) from `scale`: [E] (one per expert) or [E, n]."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.device != device:
        raise TypeError(f"{name} must be a float32 tensor on {device} ([{experts}] per expert or [{experts}, {n}] "
                        "per output column)")
    if tuple(scale.shape) == (experts,):
        return scale[:, None].expand(experts, n).contiguous()
    if tuple(scale.shape) != (experts, n):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}: expected [{experts}] or [{experts}, {n}]")
    return scale.contiguous()


class _MoEOp:
    """Construction shared by both ops: local checks (every PE learns whether all passed), then agreement on the
    arguments, then the collectives' own constructions."""

    def __init__(self, op: str, max_m: int, hidden: int, inter: int, num_experts: int, topk: int,
                 dtype: torch.dtype, layout: str, mode: str, parallel: str = "tp"):
        with collective.all_or_none(f"{op} construction"):  # an error on one PE reaches every PE
            self.rt = get_runtime()
            W = self.rt.world_size
            self.max_m, self.hidden, self.inter = (positive(n, v) for n, v in
                                                   (("max_m", max_m), ("hidden", hidden), ("inter", inter)))
            self.num_experts, self.topk = positive("num_experts", num_experts), positive("topk", topk)
            if topk > num_experts:
                raise ValueError(f"topk={topk} exceeds num_experts={num_experts}: each token picks topk distinct "
                                 "experts")
            if max_m % W:
                raise ValueError(f"max_m={max_m} must be a multiple of the world size {W} (every PE holds "
                                 f"max_m / {W} tokens at most)")
            _check_dtype(op, dtype)
            align = 16 if dtype == E4M3 else 8
            for name, v in (("hidden", hidden), ("inter", inter)):
                if v % align:
                    raise ValueError(f"{op}: {name}={v} must be a multiple of {align} (rows of 16 bytes for the "
                                     "grouped GEMM's TMA loads): pad the weights")
            _check_choice("layout", layout, LAYOUTS)
            if dtype == E4M3 and layout != "nk":
                raise ValueError(f"{op}: fp8 experts take 'nk' weights [E, N, K] (torch._scaled_grouped_mm reads B "
                                 "column-major): pass layout='nk' with w as nn.Linear stores it")
            _check_choice("mode", mode, MODES)
            if mode == "fused":
                raise NotImplementedError(f"{op}(mode='fused'): the fused grouped kernel is not built yet (issue 38); "
                                          "mode='auto' or 'decomposed' runs our collective beside torch's grouped "
                                          "GEMM")
            _check_choice("parallel", parallel, PARALLEL)
            if parallel == "ep":
                if num_experts % W:
                    raise ValueError(f"{op}(parallel='ep'): num_experts={num_experts} does not split over {W} PEs "
                                     f"(each holds num_experts / world whole experts): use a multiple of {W}, or "
                                     "parallel='tp'")
                if mode == "pipelined":
                    raise ValueError(f"{op}(parallel='ep', mode='pipelined'): the pipelined path shards experts "
                                     "(parallel='tp'); use mode='decomposed' for expert parallelism")
            self.dtype, self.layout, self.mode, self.parallel = dtype, layout, mode, parallel
        symmetric.agree(f"{op}(max_m, hidden, inter, num_experts, topk, dtype, layout, mode, parallel)",
                        (max_m, hidden, inter, num_experts, topk, str(dtype), layout, mode, parallel))
        # the experts whose weights this PE holds: all (each a shard) or its own whole ones
        self.local_experts = num_experts // W if parallel == "ep" else num_experts
        self.first_expert = self.rt.rank * self.local_experts if parallel == "ep" else 0
        self.shard_m = max_m // W
        self.op = op
        self.fp8 = dtype == E4M3
        self.out_dtype = torch.bfloat16  # (the fp8 products too)
        self.comm_stream, self.sms = None, 0
        if self.pipelined():  # its comm kernels run on a side stream, beside the current stream's grouped GEMMs
            self.sms = sm_budget(self.rt.device).sms
            self.comm_stream = partition.side_stream(self.rt.device,
                                                     priority=min(torch.cuda.Stream.priority_range()))

    def __repr__(self) -> str:
        ep = (f", parallel='ep' (experts {self.first_expert}..{self.first_expert + self.local_experts - 1} here)"
              if self.parallel == "ep" else "")
        return (f"{self.op}(max_m={self.max_m}, hidden={self.hidden}, inter={self.inter}, experts={self.num_experts}, "
                f"topk={self.topk}, dtype={self.dtype}, layout={self.layout!r}, world={self.rt.world_size}{ep}; "
                f"{self.path()})")

    def weight_shape(self, n: int, k: int) -> tuple[int, int, int]:
        e = self.local_experts
        return (e, n, k) if self.layout == "nk" else (e, k, n)

    def check_weight(self, w: torch.Tensor, n: int, k: int) -> None:
        check_tensor("w", w, dtype=self.dtype, device=self.rt.device, ndim=3)
        if tuple(w.shape) != self.weight_shape(n, k):
            raise ValueError(f"w has shape {tuple(w.shape)}; this {self.op} (layout={self.layout!r}) takes "
                             f"{self.weight_shape(n, k)}: [experts, {'N, K' if self.layout == 'nk' else 'K, N'}]")

    def check_bias(self, bias: Optional[torch.Tensor], shape: tuple) -> None:
        if bias is not None:
            check_tensor("bias", bias, dtype=self.out_dtype, device=self.rt.device, ndim=len(shape))
            if tuple(bias.shape) != shape:
                raise ValueError(f"bias has shape {tuple(bias.shape)}, expected {shape}")

    def check_no_scales(self, *scales) -> None:
        if not self.fp8 and any(sc is not None for sc in scales):
            raise ValueError(f"{self.op}: scales were given to a {self.dtype} op: they belong to fp8 experts "
                             "(build the op with dtype=torch.float8_e4m3fn)")
        if self.fp8 and any(sc is None for sc in scales):
            raise ValueError(f"{self.op}: fp8 experts need scale (the activations': [] or one per row) and w_scale "
                             "(the weights': [E] or [E, N])")

    def product(self, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, a_rows_scale, w_scale, n: int):
        """The grouped product of this op's dtype: bf16 grouped_mm, or the scaled fp8 one."""
        if not self.fp8:
            return grouped_mm(a, w, offs, self.layout)
        return scaled_grouped_mm(a, w, a_rows_scale, expert_scales("w_scale", w_scale, self.local_experts, n,
                                                                   a.device), offs)

    def grouped(self, a: torch.Tensor, w: torch.Tensor, routing: pmoe.Routing, a_rows_scale, w_scale,
                n: int) -> torch.Tensor:
        """`product` over every row of `routing`'s layout: one grouped GEMM, or one per block (blocked)."""
        if not routing.blocked:
            return self.product(a, w, routing.offs, a_rows_scale, w_scale, n)
        out = torch.empty((a.shape[0], n), dtype=self.out_dtype, device=a.device)
        for s, (lo, hi, _, _) in enumerate(routing.blocks()):
            out[lo:hi] = self.product(a[lo:hi], w, routing.block_offs(s),
                                      None if a_rows_scale is None else a_rows_scale[lo:hi], w_scale, n)
        return out

    def pipelined(self) -> bool:
        return self.mode == "pipelined" and self.rt.world_size > 1

    def comm_blocks_beside(self, blocks: int) -> int:
        """Comm blocks beside torch's grouped GEMM (which sizes its grid for the whole GPU): at most an eighth of
        this context's SMs ($FLUX_SHMEM_MOE_COMM_BLOCKS: exactly that many, an experiment's knob)."""
        forced = os.environ.get("FLUX_SHMEM_MOE_COMM_BLOCKS")
        return int(forced) if forced else max(1, min(blocks, self.sms // 8))

    def check_tokens(self, m: int) -> None:
        if not 0 < m <= self.shard_m:
            raise ValueError(f"this PE holds {m} tokens; the op takes 1..{self.shard_m} per PE (max_m={self.max_m} "
                             f"over {self.rt.world_size} PEs): build it with a larger max_m")


class AllGatherGroupGEMM(_MoEOp):
    """y = grouped_mm(all_gather(x)[rows], w[e]): every PE's tokens gathered, each (token, slot) pair multiplied by
    its expert's weight shard, rows grouped expert by expert (returned with the `Routing` that says where each
    pair went). x [m, hidden] on every PE (m <= max_m / world, the same m on every PE), topk_ids [m, topk]
    (int32/int64, each in [0, num_experts)), w [E, inter, hidden] ('nk') or [E, hidden, inter] ('kn') with inter
    this PE's shard of the expert's intermediate size. topk_weights [m, topk] (float) travels with the ids for
    GroupGEMMReduceScatter's combine. bias: [E, inter], per expert. Returns (y, routing), and with return_rows=True
    also the grouped A rows [M * topk, hidden] (what the backward's weight gradient multiplies).

    parallel='ep' (expert parallel): PE p holds whole experts [p E / world, (p + 1) E / world): w [E / world,
    inter, hidden] with inter the experts' full intermediate size. y keeps M * topk rows: the pairs routed to this
    PE's experts first (routing.offs: their ends), the rest unwritten (GroupGEMMReduceScatter skips them).

    fp8 (dtype=torch.float8_e4m3fn, 'nk' weights): x and w in e4m3 with fp32 scales, `scale` ([] or one per token
    of x, gathered with the routing) and `w_scale` ([E] or [E, inter]); y and bias bf16.

    check_ids=True (default) checks the gathered ids on the host (one synchronisation; every PE sees the same ids,
    so a bad id raises on every PE, naming the PE whose shard holds it); pass False to skip it, e.g. inside
    CUDA-graph capture."""

    def __init__(self, max_m: int, hidden: int, inter: int, num_experts: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, *, layout: str = "nk", mode: str = "auto",
                 parallel: str = "tp", comm_blocks: int = 16):
        super().__init__("AllGatherGroupGEMM", max_m, hidden, inter, num_experts, topk, dtype, layout, mode,
                         parallel)
        W = self.rt.world_size
        # ids, weights (fp32 bits) and, fp8, the token's scale (fp32 bits) in one row of 16-byte multiples: one
        # small gather of int32 words
        self._route_cols = -(-(2 * topk + int(self.fp8)) // 4) * 4
        # pipelined: chunks of a PE's shard sent chunk by chunk, one per block of grouped rows
        chunk = dict(chunk_rows=-(-self.shard_m // PIPELINE_STEPS), chunk_major=True) if self.pipelined() else {}
        self.ag = AllGather(self.shard_m, hidden, dtype, comm_blocks=comm_blocks, **chunk) if W > 1 else None
        self.route_ag = AllGather(self.shard_m, self._route_cols, torch.float32, comm_blocks=min(comm_blocks, 4)) \
            if W > 1 else None

    def path(self) -> str:
        if self.rt.world_size == 1:
            return "one PE: torch's grouped GEMM, nothing to communicate"
        if self.pipelined():
            return (f"pipelined: our AllGather of tokens chunk by chunk ({self.ag.chunk_rows} rows of each shard) on "
                    "a side stream, torch's grouped GEMM per block of rows as its chunks arrive")
        return ("decomposed: our AllGather of tokens and routing, then torch's grouped GEMM (the fused grouped "
                "kernel is issue 38's next step)")

    def gather_routing(self, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                       token_scales: Optional[torch.Tensor] = None):
        """Every PE's ids (int64), weights (fp32) and token scales ([m] fp32, fp8 ops), PE order; None where not
        given."""
        if self.route_ag is None:
            return (topk_ids.to(torch.int64), None if topk_weights is None else topk_weights.float(), token_scales)
        m, k = topk_ids.shape
        # (packed as int32 words, the fp32 bits among them: only integer copies touch them, and the all-gather
        # moves bytes)
        packed = torch.zeros((m, self._route_cols), dtype=torch.int32, device=topk_ids.device)
        packed[:, :k] = topk_ids
        if topk_weights is not None:
            packed[:, k:2 * k] = topk_weights.float().view(torch.int32)
        if token_scales is not None:
            packed[:, 2 * k] = token_scales.view(torch.int32)
        got = self.route_ag(packed.view(torch.float32), copy=False).view(torch.int32)
        ids = got[:, :k].to(torch.int64)
        weights = None if topk_weights is None else got[:, k:2 * k].contiguous().view(torch.float32)
        return ids, weights, None if token_scales is None else got[:, 2 * k].contiguous().view(torch.float32)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor, *,
                 topk_weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, w_scale: Optional[torch.Tensor] = None,
                 check_ids: bool = True, return_rows: bool = False):
        rt = self.rt
        self.check_no_scales(scale, w_scale)
        check_tensor("x", x, dtype=self.dtype, device=rt.device)
        m = x.shape[0]
        self.check_tokens(m)
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has {x.shape[1]} columns, the op was built for hidden={self.hidden}")
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("topk_ids must be an int32 or int64 tensor of expert ids (torch.topk(...).indices)")
        if tuple(topk_ids.shape) != (m, self.topk) or topk_ids.device != x.device:
            raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)} on {topk_ids.device}; expected "
                             f"({m}, {self.topk}) on {x.device}: one row of topk expert ids per token of x")
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() or \
                    tuple(topk_weights.shape) != (m, self.topk) or topk_weights.device != x.device:
                raise ValueError(f"topk_weights must be a float tensor of shape ({m}, {self.topk}) on {x.device}")
        self.check_weight(w, self.inter, self.hidden)
        self.check_bias(bias, (self.local_experts, self.inter))
        if self.pipelined():
            y, routing, rows = self._pipelined(x, topk_ids, w, topk_weights, scale, w_scale, check_ids,
                                               return_rows)
        else:
            ids, weights, scales = self.gather_routing(topk_ids, topk_weights,
                                                       row_scales("scale", scale, m, x.device) if self.fp8 else None)
            if check_ids:
                pmoe.check_ids(ids, self.num_experts, m)
            routing = pmoe.route(ids, self.num_experts, weights) if self.parallel == "tp" else \
                pmoe.route_local(ids, self.num_experts, self.first_expert, self.local_experts, weights)
            tokens = self.ag(x, copy=False) if self.ag is not None else x
            rows = tokens.index_select(0, routing.rows)
            y = self.product(rows, w, routing.offs, None if scales is None else scales.index_select(0, routing.rows),
                             w_scale, self.inter)
        if bias is not None:
            y += bias.index_select(0, row_experts(routing))
        return (y, routing, rows) if return_rows else (y, routing)

    def _pipelined(self, x, topk_ids, w, topk_weights, scale, w_scale, check_ids: bool, return_rows: bool):
        """The tokens' all-gather starts first on the side stream, chunk by chunk; the routing is gathered and
        laid out in blocks (one per chunk) meanwhile; block s's grouped GEMM waits for chunk s of every shard."""
        signals.check_errors()
        rt, ag, main = self.rt, self.ag, torch.cuda.current_stream()
        W, m = rt.world_size, x.shape[0]
        self.comm_stream.wait_stream(main)
        # (each destination's chunks one after another, a few blocks per destination: chunk s of every shard
        # arrives before chunk s + 1)
        per_dest = max(1, self.comm_blocks_beside(ag.comm_blocks) // (W - 1))
        # (no x.record_stream: the call ends with the current stream waiting for the side stream, so whatever the
        # caller's stream does with x's memory afterwards follows the side stream's reads; a record_stream'd block
        # can make a later allocation wait on the host for its event)
        tokens = ag.launch(x, stream=self.comm_stream, wait_all=False, blocks=(W - 1) * per_dest)
        ids, weights, scales = self.gather_routing(topk_ids, topk_weights,
                                                   row_scales("scale", scale, m, x.device) if self.fp8 else None)
        if check_ids:
            try:
                pmoe.check_ids(ids, self.num_experts, m)
            except ValueError:  # (every PE raises alike) the gather ran: end its epoch, or the next call's waits
                main.wait_stream(self.comm_stream)  # would pass on this call's flags
                ag.sync.bump(main)
                raise
        routing = pmoe.route(ids, self.num_experts, weights, shard_tokens=m, chunk_tokens=ag.chunk_rows)
        y = torch.empty((W * m * self.topk, self.inter), dtype=self.out_dtype, device=x.device)
        token_rows = routing.rows
        for s, (lo, hi, _, _) in enumerate(routing.blocks()):  # (block s: chunk s of every shard)
            ag.wait_chunk(m, s, main)
            rows = tokens.index_select(0, token_rows[lo:hi])
            y[lo:hi] = self.product(rows, w, routing.block_offs(s),
                                    None if scales is None else scales.index_select(0, token_rows[lo:hi]),
                                    w_scale, self.inter)
        rows = tokens.index_select(0, token_rows) if return_rows else None
        main.wait_stream(self.comm_stream)
        ag.sync.bump(main)
        return y, routing, rows


class GroupGEMMReduceScatter(_MoEOp):
    """out = reduce_scatter(sum_j weights[t, j] * (h @ w[e])[slot (t, j)]): each expert's rows of h times its
    weight shard, each token's topk results combined with the router's weights (fp32), summed over PEs and
    scattered by token rows: [m, hidden] on every PE, its own tokens. h [M * topk, inter] in `routing`'s grouped
    order (AllGatherGroupGEMM's output after the activation), w [E, hidden, inter] ('nk') or [E, inter, hidden]
    ('kn'); routing from AllGatherGroupGEMM (its weights, or topk_weights [M, topk] of every PE's tokens here).
    bias [E, hidden], per expert (weighted like its expert's output, added once).

    fp8 (dtype=torch.float8_e4m3fn, 'nk' weights): h and w in e4m3 with fp32 scales, `scale` ([] or one per row
    of h) and `w_scale` ([E] or [E, hidden]); the partial products, the sums and out are bf16.

    parallel='ep': w [E / world, hidden, inter] (this PE's whole experts), the routing of an expert-parallel
    AllGatherGroupGEMM; each PE combines the slots of its own experts, the reduce-scatter sums them."""

    def __init__(self, max_m: int, hidden: int, inter: int, num_experts: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, *, layout: str = "nk", mode: str = "auto",
                 parallel: str = "tp", comm_blocks: int = 16):
        super().__init__("GroupGEMMReduceScatter", max_m, hidden, inter, num_experts, topk, dtype, layout, mode,
                         parallel)
        self.rs = ReduceScatter(max_m, hidden, self.out_dtype, comm_blocks=comm_blocks) \
            if self.rt.world_size > 1 else None
        self._marks: dict[tuple[int, int], list[torch.Tensor]] = {}  # pipelined: tiles each block completes

    def path(self) -> str:
        if self.rt.world_size == 1:
            return "one PE: torch's grouped GEMM and the top-k combine, nothing to communicate"
        if self.pipelined():
            return ("pipelined: torch's grouped GEMM and the top-k combine per block of a blocked routing (from "
                    "AllGatherGroupGEMM(mode='pipelined')), our reduce kernel beside them on a side stream summing "
                    "each block's rows once every PE has written them")
        return ("decomposed: torch's grouped GEMM, the top-k combine in fp32, then our ReduceScatter (the fused "
                "grouped kernel is issue 38's next step)")

    @property
    def adds_bias(self) -> bool:
        """Whether this PE adds the experts' biases to its partial products: the sum over PEs must hold each once
        (TP: PE 0 adds them all; EP: every PE its own experts')."""
        return self.rt.rank == 0 or self.parallel == "ep"

    def marks(self, rows: int, seg_rows: int, chunk_rows: int) -> list[torch.Tensor]:
        """Per block of a blocked routing: the reduce-scatter addend's M-tiles (int64, device) complete once the
        block's rows are written (`schedules.chunk_step_of_tiles`). Made on the first call of a shape (not
        inside a CUDA-graph capture: call once before capturing)."""
        key = (rows, chunk_rows)
        if key not in self._marks:
            not_capturing(f"{self.op}(mode='pipelined') with {rows} rows")
            step = chunk_step_of_tiles(rows, seg_rows, chunk_rows, self.rs.engine.tile_m)
            dev = f"cuda:{self.rt.device}"
            self._marks[key] = [torch.tensor([t for t, st in enumerate(step) if st == s], dtype=torch.int64,
                                             device=dev) for s in range(max(step) + 1)]
        return self._marks[key]

    def __call__(self, h: torch.Tensor, w: torch.Tensor, routing: pmoe.Routing, *,
                 topk_weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, w_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        rt = self.rt
        W = rt.world_size
        self.check_no_scales(scale, w_scale)
        if not isinstance(routing, pmoe.Routing):
            raise TypeError("routing must be the Routing that AllGatherGroupGEMM returned with its output")
        if routing.num_experts != self.num_experts or routing.topk != self.topk:
            raise ValueError(f"routing is for {routing.num_experts} experts, top-{routing.topk}; this op was built "
                             f"for {self.num_experts}, top-{self.topk}")
        if (routing.first_expert, routing.experts_here) != (self.first_expert, self.local_experts):
            last = routing.first_expert + routing.experts_here - 1
            raise ValueError(f"routing groups experts {routing.first_expert}..{last}; this op "
                             f"(parallel={self.parallel!r}) holds experts {self.first_expert}.."
                             f"{self.first_expert + self.local_experts - 1}: build both ops with the same parallel")
        M = routing.tokens
        if M % W:
            raise ValueError(f"routing holds {M} tokens, not a multiple of the world size {W}")
        self.check_tokens(M // W)
        check_tensor("h", h, dtype=self.dtype, device=rt.device)
        if tuple(h.shape) != (M * self.topk, self.inter):
            raise ValueError(f"h has shape {tuple(h.shape)}; expected ({M * self.topk}, {self.inter}): the grouped "
                             "rows of AllGatherGroupGEMM's output (tokens x topk, this PE's inter shard)")
        self.check_weight(w, self.hidden, self.inter)
        self.check_bias(bias, (self.local_experts, self.hidden))
        weights = topk_weights if topk_weights is not None else routing.weights
        if weights is None:
            raise ValueError("no combine weights: pass topk_weights to AllGatherGroupGEMM (they travel in the "
                             f"routing) or topk_weights [{M}, {self.topk}] of every PE's tokens here")
        if tuple(weights.shape) != (M, self.topk) or not weights.is_floating_point():
            raise ValueError(f"topk_weights must be a float tensor of shape ({M}, {self.topk}): every PE's tokens, "
                             "PE order")
        rows_scale = row_scales("scale", scale, h.shape[0], h.device) if self.fp8 else None
        if self.pipelined():
            return self._pipelined(h, w, routing, weights.float().contiguous(), rows_scale, w_scale, bias)
        partial = self.grouped(h, w, routing, rows_scale, w_scale, self.hidden)
        if bias is not None and self.adds_bias:
            partial += bias.index_select(0, row_experts(routing))
        out = combine(partial, routing, weights)
        return self.rs(out) if self.rs is not None else out

    def _pipelined(self, h, w, routing: pmoe.Routing, weights: torch.Tensor, rows_scale, w_scale, bias):
        """Block s's grouped GEMM and combine write rows [s c, (s + 1) c) of every segment of this PE's addend, then
        mark the tiles they complete; the reduce kernel beside them on the side stream waits, unit by unit, for
        the tiles of every node PE's addend. It is enqueued after every block (its stream waiting only for the
        barrier): enqueued first, it timed out on every PE waiting for the PE's own first tile, whose marks never
        ran (2026-12-07, H100, 2 and 4 PEs under MPS; the likely cause, not pinned down, a host synchronisation
        among the blocks' launches while the kernel spun on marks enqueued after it)."""
        signals.check_errors()
        rt, eng, main = self.rt, self.rs.engine, torch.cuda.current_stream()
        W, M = rt.world_size, routing.tokens
        m = M // W
        chunk = routing.chunk_tokens if routing.blocked else m
        out = torch.empty((m, self.hidden), dtype=self.out_dtype, device=h.device)
        marks = self.marks(M, m, chunk)
        eng.sync.barrier(main)  # every PE is past its previous call: nobody still reads my addend
        past_barrier = torch.cuda.Event()
        past_barrier.record(main)
        addend = eng.partial[:M].view(W, m, self.hidden)
        expert_of_row = row_experts(routing) if bias is not None else None
        for s, (lo, hi, t0, t1) in enumerate(routing.blocks()):
            partial = self.product(h[lo:hi], w, routing.block_offs(s),
                                   None if rows_scale is None else rows_scale[lo:hi], w_scale, self.hidden)
            if bias is not None and self.adds_bias:
                partial += bias.index_select(0, expert_of_row[lo:hi])
            if routing.blocked:
                addend[:, t0:t1].copy_(combine_block(partial, routing, weights, s))
            else:
                addend.view(M, self.hidden).copy_(combine(partial, routing, weights))
            # (after the writes on this stream: a peer that sees a mark sees the rows)
            eng.tile_ready.index_put_((marks[s],), eng.sync.epoch.expand(marks[s].numel()))
        self.comm_stream.wait_event(past_barrier)
        eng.launch(M, out, src=None, bias=None, stream=self.comm_stream,
                   blocks=self.comm_blocks_beside(eng.comm_blocks), chunk_rows=chunk)
        main.wait_stream(self.comm_stream)  # (out is the caller's from here: no record_stream, as in the up op)
        eng.sync.bump(main)
        return out
