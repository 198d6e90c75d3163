"""`flux_shmem.nn.MoE`: a Mixtral-style sparse expert block, tensor-parallel experts, sequence parallel between
blocks (issue 38):

    probs = softmax(router(x)); weights, ids = topk(probs)         (renormalised over the top-k by default)
    y, routing = AllGatherGroupGEMM(x, ids, w_gate_up)             every PE's tokens, grouped by expert
    out = GroupGEMMReduceScatter(silu(gate) * up, w_down, routing)  this PE's tokens [m, hidden]

with autograd (eager): the backward of each op is the other's communication (an all-gather's backward is a
reduce-scatter and vice versa), the weight gradients are grouped GEMMs over each expert's rows:

    MoE up   (x, w1)  -> y          dx = reduce_scatter(sum over slots of dy @ w1[e]), dw1[e] = dy_e^T x_e
    MoE down (h, w2, weights) -> out  g = all_gather(dout): dh = (weights * g) @ w2[e], dw2[e] = (weights g)_e^T h_e,
                                      dweights[t, j] = reduce_scatter(<g[t], (h @ w2[e]^T)[t, j]>)

The router is replicated: its weight's gradient here comes from this PE's tokens only, so all-reduce it over the
PEs (as for any sequence-parallel replicated parameter) before the optimizer step. torch.compile and CUDA-graph
capture of the block are not supported yet (the routing check reads the ids on the host; pass check_ids=False to
skip it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import moe as ops
from ..plan import moe as pmoe
from ..runtime import state


def _gathered(ag, t: torch.Tensor) -> torch.Tensor:
    return ag(t, copy=False) if ag is not None else t


def _scattered(rs, t: torch.Tensor) -> torch.Tensor:
    return rs(t) if rs is not None else t


class _Up(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, ids, weights, block: "MoE", check_ids: bool):
        y, routing, xs = block.up(x, ids, w1, topk_weights=weights.detach(), check_ids=check_ids, return_rows=True)
        ctx.block, ctx.routing = block, routing
        ctx.save_for_backward(w1, xs)  # (xs: each expert's rows, for dw1)
        ctx.mark_non_differentiable(routing.perm, routing.inverse, routing.offs, routing.ids, routing.weights)
        return y, routing.perm, routing.inverse, routing.offs, routing.ids, routing.weights

    @staticmethod
    def backward(ctx, dy, *_routing):
        w1, xs = ctx.saved_tensors
        b, r = ctx.block, ctx.routing
        dy = dy.contiguous()
        dxs = ops.grouped_mm(dy, w1, r.offs, "kn" if b.up.layout == "nk" else "nk")    # dy @ w1[e]: [R, hidden]
        dx_full = dxs.index_select(0, r.inverse).view(r.tokens, r.topk, -1).float().sum(1).to(dy.dtype)
        dx = _scattered(b.down.rs, dx_full)
        dw1 = torch._grouped_mm(dy.t(), xs, offs=r.offs)                             # [E, 2 inter, hidden]
        return dx, dw1 if b.up.layout == "nk" else dw1.transpose(1, 2).contiguous(), None, None, None, None


class _Down(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w2, weights, block: "MoE", routing: pmoe.Routing):
        ctx.block, ctx.routing = block, routing
        partial = ops.grouped_mm(h, w2, routing.offs, block.down.layout)
        out = _scattered(block.down.rs, ops.combine(partial, routing, routing.weights))
        ctx.save_for_backward(h, w2, partial)
        return out

    @staticmethod
    def backward(ctx, dout):
        h, w2, partial = ctx.saved_tensors
        b, r = ctx.block, ctx.routing
        g = _gathered(b.up.ag, dout.contiguous())                                      # [M, hidden]
        gs = g.index_select(0, r.rows)                                                  # per grouped row
        w_rows = r.weights.reshape(-1).index_select(0, r.perm)
        dpartial = (gs.float() * w_rows[:, None]).to(h.dtype)
        dh = ops.grouped_mm(dpartial, w2, r.offs, "kn" if b.down.layout == "nk" else "nk")
        dw2 = torch._grouped_mm(dpartial.t(), h, offs=r.offs)                           # [E, hidden, inter]
        dw_rows = (gs.float() * partial.float()).sum(1)                                 # <g[t], partial[t, j]>
        dweights = dw_rows.index_select(0, r.inverse).view(r.tokens, r.topk)
        dweights = b.scatter_weights(dweights)                                          # summed over PEs: [m, k]
        return dh, dw2 if b.down.layout == "nk" else dw2.transpose(1, 2).contiguous(), dweights, None, None


class MoE(nn.Module):
    """A sparse MoE block for this PE's tokens x [m, hidden] (m <= max_tokens / world): num_experts experts of
    intermediate size `inter` (each PE holds inter / world of every expert), top-k routing with a replicated
    linear router. Weights: router.weight [E, hidden]; w_gate_up [E, 2 inter / world, hidden] (gate rows, then up
    rows); w_down [E, hidden, inter / world]. Needs flux_shmem.init() first (one PE runs without collectives)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, topk: int, *, max_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, norm_topk: bool = True, check_ids: bool = True):
        super().__init__()
        rt = state.get_runtime()
        W = rt.world_size
        if inter % W:
            raise ValueError(f"MoE: inter = {inter} does not split over {W} PEs: use a multiple of {W}")
        self.hidden, self.inter, self.num_experts, self.topk = hidden, inter, num_experts, topk
        self.inter_local, self.norm_topk, self.check_ids = inter // W, norm_topk, check_ids
        self.up = ops.AllGatherGroupGEMM(max_tokens, hidden, 2 * self.inter_local, num_experts, topk, dtype)
        self.down = ops.GroupGEMMReduceScatter(max_tokens, hidden, self.inter_local, num_experts, topk, dtype)
        # (the router weights' gradient, summed over PEs: one small fp32 reduce-scatter of 16-byte rows)
        self._weight_cols = -(-topk // 4) * 4
        self._weights_rs = None
        if W > 1:
            from ..ops.reduce_scatter import ReduceScatter
            self._weights_rs = ReduceScatter(max_tokens, self._weight_cols, torch.float32, comm_blocks=4)
        if device is None:
            device = torch.device("cuda", rt.device)
        kw = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * self.inter_local, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, self.inter_local, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan_in) per expert (the full layer's fan-in), like torch.nn.Linear."""
        for w, fan_in in ((self.w_gate_up, self.hidden), (self.w_down, self.inter)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, inter={self.inter}, experts={self.num_experts}, topk={self.topk}, local "
                f"w_gate_up={list(self.w_gate_up.shape)}, w_down={list(self.w_down.shape)}; {self.up.path()}")

    def scatter_weights(self, dweights: torch.Tensor) -> torch.Tensor:
        """[M, topk] fp32 per PE -> this PE's tokens' rows of the sum over PEs."""
        if self._weights_rs is None:
            return dweights
        padded = F.pad(dweights, (0, self._weight_cols - self.topk))
        return self._weights_rs(padded.contiguous())[:, : self.topk]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [m, topk] int64, weights [m, topk] fp32 with autograd to the router)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        y, *routing = _Up.apply(x, self.w_gate_up, ids, weights, self, self.check_ids)
        perm, inverse, offs, all_ids, all_weights = routing
        gate, up = y.split(self.inter_local, dim=1)
        h = (F.silu(gate.float()) * up.float()).to(x.dtype)
        r = pmoe.Routing(all_ids, all_weights, perm, inverse, offs, self.num_experts)
        return _Down.apply(h.contiguous(), self.w_down, weights, self, r)
