"""`flux_shmem.nn.MoE`: a Mixtral-style sparse expert block, tensor-parallel experts, sequence parallel between
blocks (issue 38):

    probs = softmax(router(x)); weights, ids = topk(probs)         (renormalised over the top-k by default)
    y, routing = AllGatherGroupGEMM(x, ids, w_gate_up)             every PE's tokens, grouped by expert
    out = GroupGEMMReduceScatter(silu(gate) * up, w_down, routing)  this PE's tokens [m, hidden]

as custom ops (torch.ops.flux_shmem.moe_up / moe_down, fake kernels for torch.compile) whose backward is the other
op's communication (an all-gather's backward is a reduce-scatter and vice versa), the weight gradients grouped
GEMMs over each expert's rows:

    MoE up   (x, w1)  -> y          dx = reduce_scatter(sum over slots of dy @ w1[e]), dw1[e] = dy_e^T x_e
    MoE down (h, w2, weights) -> out  g = all_gather(dout): dh = (weights * g) @ w2[e], dw2[e] = (weights g)_e^T h_e,
                                      dweights[t, j] = reduce_scatter(<g[t], (h @ w2[e]^T)[t, j]>)

The router is replicated: its weight's gradient here comes from this PE's tokens only, so all-reduce it over the
PEs (as for any sequence-parallel replicated parameter) before the optimizer step. CUDA-graph capture needs
check_ids=False (the routing check reads the ids on the host).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import moe as ops
from ..plan import moe as pmoe
from ..runtime import state
from . import backends


def _gathered(ag, t: torch.Tensor) -> torch.Tensor:
    return ag(t, copy=False) if ag is not None else t


def _scattered(rs, t: torch.Tensor) -> torch.Tensor:
    return rs(t) if rs is not None else t


class MoEEngine:
    """What the custom ops reach through their handle: the block's two ops and the router weights' reduce."""

    def __init__(self, up: ops.AllGatherGroupGEMM, down: ops.GroupGEMMReduceScatter, weights_rs, topk: int):
        self.up, self.down, self.weights_rs, self.topk = up, down, weights_rs, topk
        self.weight_cols = -(-topk // 4) * 4

    def scatter_weights(self, dweights: torch.Tensor) -> torch.Tensor:
        """[M, topk] fp32 per PE -> this PE's tokens' rows of the sum over PEs."""
        if self.weights_rs is None:
            return dweights.clone()
        padded = F.pad(dweights, (0, self.weight_cols - self.topk))
        return self.weights_rs(padded.contiguous())[:, : self.topk].contiguous()


def _local(engine: MoEEngine, all_ids: Tensor) -> Optional[Tensor]:
    """[M, topk] bool: the slots whose expert is on this PE (expert parallel); None: every one (TP)."""
    up = engine.up
    return pmoe.local_slots(all_ids, up.first_expert, up.local_experts) if up.parallel == "ep" else None


def _routing(engine: MoEEngine, perm, inverse, offs, all_ids, all_weights) -> pmoe.Routing:
    up = engine.up
    if up.parallel != "ep":
        return pmoe.Routing(all_ids, all_weights, perm, inverse, offs, up.num_experts)
    return pmoe.Routing(all_ids, all_weights, perm, inverse, offs, up.num_experts, first_expert=up.first_expert,
                        local_experts=up.local_experts, local=_local(engine, all_ids))


# ------------------------------------------------------------------------------------------------------------
# The block's custom ops (torch.compile traces them by their fake kernels; autograd: the other op's collective)
@torch.library.custom_op("flux_shmem::moe_up", mutates_args=())
def moe_up(x: Tensor, w1: Tensor, ids: Tensor, weights: Tensor, handle: int, world: int, num_experts: int,
           check_ids: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y [M k, N], perm, inverse, offs, every PE's ids [M, k], weights [M, k], the grouped A rows [M k, H])."""
    e = backends.lookup(handle)
    y, r, xs = e.up(x, ids, w1, topk_weights=weights, check_ids=check_ids, return_rows=True)
    return y, r.perm, r.inverse, r.offs, r.ids.clone(), r.weights.clone(), xs


@moe_up.register_fake
def _moe_up_fake(x, w1, ids, weights, handle, world, num_experts, check_ids):
    M, k = x.shape[0] * world, ids.shape[1]
    R = M * k
    return (x.new_empty((R, w1.shape[1])), ids.new_empty((R,), dtype=torch.int64),
            ids.new_empty((R,), dtype=torch.int64), ids.new_empty((num_experts,), dtype=torch.int32),
            ids.new_empty((M, k), dtype=torch.int64), weights.new_empty((M, k), dtype=torch.float32),
            x.new_empty((R, x.shape[1])))


@torch.library.custom_op("flux_shmem::moe_up_backward", mutates_args=())
def moe_up_backward(dy: Tensor, w1: Tensor, xs: Tensor, inverse: Tensor, offs: Tensor, local: Optional[Tensor],
                    handle: int, world: int, topk: int) -> tuple[Tensor, Tensor]:
    """(dx [m, H]: the slots' dy @ w1[e] summed per token and over PEs, dw1 [E, N, H] = dy_e^T xs_e; expert
    parallel: over this PE's experts, `local` its slots)."""
    e, k = backends.lookup(handle), topk
    dxs = ops.grouped_mm(dy, w1, offs, "kn")                                         # dy @ w1[e]: [R, H]
    dx_full = ops.slot_values(dxs, inverse, local, k).sum(1).to(dy.dtype)
    return _scattered(e.down.rs, dx_full), torch._grouped_mm(dy.t(), xs, offs=offs)


@moe_up_backward.register_fake
def _moe_up_backward_fake(dy, w1, xs, inverse, offs, local, handle, world, topk):
    return xs.new_empty((inverse.shape[0] // topk // world, xs.shape[1])), w1.new_empty(w1.shape)


def _moe_up_setup(ctx, inputs, output):
    x, w1, ids, weights, handle, world, num_experts, check_ids = inputs
    ctx.handle, ctx.world, ctx.topk = handle, world, ids.shape[1]
    ctx.save_for_backward(w1, output[6], output[2], output[3], output[4])


def _moe_up_grad(ctx, dy, *_routing):
    w1, xs, inverse, offs, all_ids = ctx.saved_tensors
    local = _local(backends.lookup(ctx.handle), all_ids)
    dx, dw1 = torch.ops.flux_shmem.moe_up_backward(dy.contiguous(), w1, xs, inverse, offs, local, ctx.handle,
                                                   ctx.world, ctx.topk)
    return dx, dw1, None, None, None, None, None, None


@torch.library.custom_op("flux_shmem::moe_down", mutates_args=())
def moe_down(h: Tensor, w2: Tensor, weights: Tensor, perm: Tensor, inverse: Tensor, offs: Tensor, all_ids: Tensor,
             all_weights: Tensor, handle: int, world: int) -> tuple[Tensor, Tensor]:
    """(out [m, H]: this PE's tokens, the grouped products [M k, H] its backward reads). `weights` (this PE's
    router weights) only carries the router's gradient; the combine reads all_weights, every PE's."""
    e = backends.lookup(handle)
    r = _routing(e, perm, inverse, offs, all_ids, all_weights)
    partial = ops.grouped_mm(h, w2, offs, "nk")
    return _scattered(e.down.rs, ops.combine(partial, r, all_weights)), partial


@moe_down.register_fake
def _moe_down_fake(h, w2, weights, perm, inverse, offs, all_ids, all_weights, handle, world):
    return h.new_empty((weights.shape[0], w2.shape[1])), h.new_empty((h.shape[0], w2.shape[1]))


@torch.library.custom_op("flux_shmem::moe_down_backward", mutates_args=())
def moe_down_backward(dout: Tensor, h: Tensor, w2: Tensor, partial: Tensor, perm: Tensor, inverse: Tensor,
                      offs: Tensor, all_weights: Tensor, local: Optional[Tensor], handle: int, world: int, topk: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dw2, dweights [m, k]) from g = every PE's dout: dpartial = weights * g per slot, dh = dpartial @ w2[e],
    dw2[e] = dpartial_e^T h_e, dweights[t, j] = <g[t], partial[slot]> summed over PEs."""
    e, k = backends.lookup(handle), topk
    g = _gathered(e.up.ag, dout)                                                     # [M, H]
    gs = g.index_select(0, perm // k)                                                # per grouped row
    dpartial = (gs.float() * all_weights.reshape(-1).index_select(0, perm)[:, None]).to(h.dtype)
    dh = ops.grouped_mm(dpartial, w2, offs, "kn")
    dw2 = torch._grouped_mm(dpartial.t(), h, offs=offs)                              # [E, H, inter]
    dw_rows = (gs.float() * partial.float()).sum(1, keepdim=True)
    dweights = e.scatter_weights(ops.slot_values(dw_rows, inverse, local, k).squeeze(-1))
    return dh, dw2, dweights


@moe_down_backward.register_fake
def _moe_down_backward_fake(dout, h, w2, partial, perm, inverse, offs, all_weights, local, handle, world, topk):
    return h.new_empty(h.shape), w2.new_empty(w2.shape), all_weights.new_empty((dout.shape[0], all_weights.shape[1]))


def _moe_down_setup(ctx, inputs, output):
    h, w2, weights, perm, inverse, offs, all_ids, all_weights, handle, world = inputs
    ctx.handle, ctx.world = handle, world
    ctx.save_for_backward(h, w2, output[1], perm, inverse, offs, all_ids, all_weights)


def _moe_down_grad(ctx, dout, _dpartial):
    h, w2, partial, perm, inverse, offs, all_ids, all_weights = ctx.saved_tensors
    local = _local(backends.lookup(ctx.handle), all_ids)
    dh, dw2, dweights = torch.ops.flux_shmem.moe_down_backward(dout.contiguous(), h, w2, partial, perm, inverse,
                                                               offs, all_weights, local, ctx.handle, ctx.world,
                                                               all_weights.shape[1])
    return dh, dw2, dweights, None, None, None, None, None, None, None


moe_up.register_autograd(_moe_up_grad, setup_context=_moe_up_setup)
moe_down.register_autograd(_moe_down_grad, setup_context=_moe_down_setup)


class MoE(nn.Module):
    """A sparse MoE block for this PE's tokens x [m, hidden] (m <= max_tokens / world): num_experts experts of
    intermediate size `inter` (each PE holds inter / world of every expert), top-k routing with a replicated
    linear router. Weights: router.weight [E, hidden]; w_gate_up [E, 2 inter / world, hidden] (gate rows, then up
    rows); w_down [E, hidden, inter / world]. parallel='ep' (expert parallel): each PE holds num_experts / world
    whole experts instead, w_gate_up [E / world, 2 inter, hidden], w_down [E / world, hidden, inter] (its
    experts are [rank E / world, (rank + 1) E / world)). Needs flux_shmem.init() first (one PE runs without
    collectives).
    torch.compile(fullgraph=True) traces it (the ops are custom ops with fake kernels); check_ids=False skips the
    host read of the ids (needed for CUDA-graph capture)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, topk: int, *, max_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, norm_topk: bool = True, check_ids: bool = True,
                 parallel: str = "tp"):
        super().__init__()
        rt = state.get_runtime()
        W = rt.world_size
        if parallel == "tp" and inter % W:
            raise ValueError(f"MoE: inter = {inter} does not split over {W} PEs: use a multiple of {W}, or "
                             "parallel='ep'")
        self.hidden, self.inter, self.num_experts, self.topk = hidden, inter, num_experts, topk
        # TP: every expert, a slice of its intermediate size; EP: num_experts / world whole experts (the ops check)
        self.inter_local = inter // W if parallel == "tp" else inter
        self.norm_topk, self.check_ids, self.world_size = norm_topk, check_ids, W
        # (decomposed: the custom ops pass the routing as tensors of the one-block layout; the pipelined ops'
        # blocked layout is not in their signatures yet)
        up = ops.AllGatherGroupGEMM(max_tokens, hidden, 2 * self.inter_local, num_experts, topk, dtype,
                                    mode="decomposed", parallel=parallel)
        down = ops.GroupGEMMReduceScatter(max_tokens, hidden, self.inter_local, num_experts, topk, dtype,
                                          mode="decomposed", parallel=parallel)
        el = up.local_experts
        # (the router weights' gradient, summed over PEs: one small fp32 reduce-scatter of 16-byte rows)
        weights_rs = None
        if W > 1:
            from ..ops.reduce_scatter import ReduceScatter
            weights_rs = ReduceScatter(max_tokens, -(-topk // 4) * 4, torch.float32, comm_blocks=4)
        self.engine = MoEEngine(up, down, weights_rs, topk)
        self._handle = backends.register(self.engine)
        if device is None:
            device = torch.device("cuda", rt.device)
        kw = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.w_gate_up = nn.Parameter(torch.empty(el, 2 * self.inter_local, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(el, hidden, self.inter_local, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan_in) per expert (the full layer's fan-in), like torch.nn.Linear."""
        for w, fan_in in ((self.w_gate_up, self.hidden), (self.w_down, self.inter)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, inter={self.inter}, experts={self.num_experts}, topk={self.topk}, local "
                f"w_gate_up={list(self.w_gate_up.shape)}, w_down={list(self.w_down.shape)}; "
                f"{self.engine.up.path()}")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [m, topk] int64, weights [m, topk] fp32 with autograd to the router)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        y, perm, inverse, offs, all_ids, all_weights, _ = torch.ops.flux_shmem.moe_up(
            x, self.w_gate_up, ids, weights, self._handle, self.world_size, self.num_experts, self.check_ids)
        gate, up = y.split(self.inter_local, dim=1)
        h = (F.silu(gate.float()) * up.float()).to(x.dtype)
        out, _ = torch.ops.flux_shmem.moe_down(h, self.w_down, weights, perm, inverse, offs, all_ids, all_weights,
                                               self._handle, self.world_size)
        return out
