"""GPU checks, group moe: the MoE ops (issue 38)

    flux-launch -n 2 tests/gpu/checks.py moe

Tensor-parallel experts: every PE builds every PE's tokens, router output and the full expert weights from shared
seeds, runs the ops on its own tokens and weight shards, and compares its output rows with an fp64 torch
reference of the whole block (up projection, SiLU, down projection, top-k combine), outputs and the gather
buffer poisoned first. Balanced, skewed and empty-expert routing, both weight layouts, a CUDA-graph replay, and
bad ids raising on every PE, and flux_shmem.nn.MoE's gradients.
"""
from __future__ import annotations

import torch

import flux_shmem
from common import capture, check, rel_err


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def routing_inputs(rt, m: int, experts: int, topk: int, kind: str, seed: int):
    """Every PE's (tokens are built by the caller) top-k ids [m, topk] and softmax weights, identical on all PEs:
    'balanced', 'skewed' (most tokens to experts 0 and 1) or 'empty' (experts 1 and E - 1 never chosen)."""
    ids, wts = [], []
    for pe in range(rt.world_size):
        logits = torch.randn(m, experts, generator=_gen(seed * 100 + pe), device="cuda")
        if kind == "skewed":
            logits[:, :2] += 4.0
        if kind == "empty":
            logits[:, [1, experts - 1]] = -1e9
        top = torch.topk(logits, topk, dim=1)
        ids.append(top.indices)
        wts.append(torch.softmax(top.values, dim=1))
    return ids, wts


def expert_weights(experts: int, n: int, k: int, layout: str, seed: int) -> torch.Tensor:
    """Full weights [E, n, k] ('nk') or [E, k, n] ('kn'), bf16, identical on every PE."""
    w = (torch.randn(experts, n, k, generator=_gen(seed), device="cuda") * k ** -0.5).to(torch.bfloat16)
    return w if layout == "nk" else w.transpose(1, 2).contiguous()


def shard(w: torch.Tensor, layout: str, dim_of_nk: int, pe: int, world: int) -> torch.Tensor:
    """PE pe's slice of w along the nk dimension `dim_of_nk` (1: N, 2: K), contiguous, in w's layout."""
    d = dim_of_nk if layout == "nk" else 3 - dim_of_nk
    size = w.shape[d] // world
    return w.narrow(d, pe * size, size).contiguous()


def reference(x, ids, wts, w1, w2, layout):
    """fp64 over every token: sum_j wts[t, j] * silu(x[t] @ W1[e]^T) @ W2[e]^T, W as [E, N, K]."""
    if layout == "kn":
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    x, w1, w2 = x.double(), w1.double(), w2.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if len(t):
            h = torch.nn.functional.silu(x[t] @ w1[e].t()) @ w2[e].t()
            out.index_add_(0, t, h * wts[t, j].double()[:, None])
    return out


def block(rt, m, hidden, inter, experts, topk, layout, kind, seed, ag=None, rs=None, modes=("auto", "auto"),
          parallel="tp"):
    """One check of the block at these sizes (the ops built in `modes`, up and down; parallel 'tp': each PE a
    shard of every expert, 'ep': its whole experts); returns (ag, rs) for reuse."""
    W, me = rt.world_size, rt.rank
    if inter % W:
        raise ValueError(f"inter={inter} must split over {W} PEs")
    xs = [torch.randn(m, hidden, generator=_gen(seed * 1000 + pe), device="cuda").to(torch.bfloat16)
          for pe in range(W)]
    ids, wts = routing_inputs(rt, m, experts, topk, kind, seed)
    w1 = expert_weights(experts, inter, hidden, layout, seed + 1)   # up: [E, inter, hidden] (nk)
    w2 = expert_weights(experts, hidden, inter, layout, seed + 2)   # down: [E, hidden, inter] (nk)
    if parallel == "ep":
        el = experts // W
        w1s, w2s, n = w1[me * el:(me + 1) * el].contiguous(), w2[me * el:(me + 1) * el].contiguous(), inter
    else:
        w1s, w2s, n = shard(w1, layout, 1, me, W), shard(w2, layout, 2, me, W), inter // W
    ag = ag or flux_shmem.AllGatherGroupGEMM(W * m, hidden, n, experts, topk, layout=layout, mode=modes[0],
                                             parallel=parallel)
    rs = rs or flux_shmem.GroupGEMMReduceScatter(W * m, hidden, n, experts, topk, layout=layout, mode=modes[1],
                                                 parallel=parallel)
    torch.cuda.synchronize()
    rt.host.barrier()  # (no PE still reads a buffer poisoned here)
    if ag.ag is not None:
        ag.ag.gather.fill_(float("nan"))
    if rs.rs is not None:
        rs.rs.engine.partial.fill_(float("nan"))
    torch.cuda.synchronize()
    rt.host.barrier()
    y, r = ag(xs[me], ids[me], w1s, topk_weights=wts[me])
    out = rs(torch.nn.functional.silu(y.float()).to(torch.bfloat16), w2s, r)
    ref = reference(torch.cat(xs), torch.cat(ids), torch.cat(wts), w1, w2, layout)[me * m:(me + 1) * m]
    err = rel_err(out, ref)
    assert out.shape == (m, hidden) and err < 1e-2, (kind, layout, m, err)
    counts = r.counts().tolist()
    every = torch.bincount(torch.cat(ids).reshape(-1), minlength=experts).tolist()
    assert counts == every[r.first_expert:r.first_expert + r.experts_here], (counts, every)
    if kind == "empty":
        assert every[1] == 0 and every[-1] == 0, every
    if modes[0] == "pipelined" and W > 1:  # several blocks once a shard has more rows than a chunk
        assert r.blocked == (m > ag.ag.chunk_rows), (m, ag.ag.chunk_rows, r.blocked)
    return ag, rs


@check("moe")
def moe_block_matches_fp64(rt):
    """Both ops, Mixtral-like proportions (8 experts, top-2) and a wide one (64 experts, top-8), both layouts, every
    routing kind, two M (the second reusing the ops)."""
    for layout in ("nk", "kn"):
        for kind in ("balanced", "skewed", "empty"):
            ag, rs = block(rt, 96, 256, 512, 8, 2, layout, kind, 1)
            block(rt, 40, 256, 512, 8, 2, layout, kind, 2, ag, rs)
    block(rt, 64, 128, 256, 64, 8, "nk", "balanced", 3)


@check("moe")
def moe_pipelined_block_matches_fp64(rt):
    """mode='pipelined' (the grouped GEMMs block by block beside our comm kernels): both ops pipelined, every
    routing kind, both layouts, M with 4 blocks and then with 2 (the last one short, the ops reused); and each op
    pipelined beside the other decomposed (a blocked routing into the decomposed down projection, a one-block
    routing into the pipelined one)."""
    for layout in ("nk", "kn"):
        for kind in ("balanced", "skewed", "empty"):
            ag, rs = block(rt, 96, 256, 512, 8, 2, layout, kind, 41, modes=("pipelined", "pipelined"))
            block(rt, 40, 256, 512, 8, 2, layout, kind, 42, ag, rs)
    block(rt, 96, 256, 512, 8, 2, "nk", "skewed", 43, modes=("pipelined", "decomposed"))
    block(rt, 96, 256, 512, 8, 2, "nk", "skewed", 44, modes=("decomposed", "pipelined"))
    block(rt, 64, 128, 256, 64, 8, "nk", "balanced", 45, modes=("pipelined", "pipelined"))


@check("moe")
def moe_expert_parallel_block_matches_fp64(rt):
    """parallel='ep' (each PE its num_experts / world whole experts): every routing kind (the empty experts on
    some PEs), both layouts, two M with the ops reused, and 64 experts top-8."""
    for layout in ("nk", "kn"):
        for kind in ("balanced", "skewed", "empty"):
            ag, rs = block(rt, 96, 256, 256, 8, 2, layout, kind, 51, parallel="ep")
            block(rt, 40, 256, 256, 8, 2, layout, kind, 52, ag, rs, parallel="ep")
    block(rt, 64, 128, 128, 64, 8, "nk", "balanced", 53, parallel="ep")


def _quantize(x, dim):
    """e4m3 values, fp32 scales along `dim` (amax / 448), and the dequantized fp64 tensor."""
    scale = (x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 448.0).float()
    q = (x / scale).to(torch.float8_e4m3fn)
    return q, scale.squeeze(dim), q.double() * scale.double()


@check("moe")
def moe_fp8_block_matches_dequantized_fp64(rt):
    """Both ops with e4m3 experts (torch._scaled_grouped_mm): tokens with one scale per row (gathered with the
    routing), up weights per output column, down weights one scale per expert; against the dequantized fp64 block
    (skewed and empty-expert routing), decomposed and pipelined."""
    for mode in ("decomposed", "pipelined"):
        _fp8_block(rt, mode)


def _fp8_block(rt, mode):
    W, me, m, hidden, inter, experts, topk = rt.world_size, rt.rank, 64, 256, 256, 8, 2
    Is = inter // W
    E4 = torch.float8_e4m3fn
    ag = flux_shmem.AllGatherGroupGEMM(W * m, hidden, Is, experts, topk, E4, mode=mode)
    rs = flux_shmem.GroupGEMMReduceScatter(W * m, hidden, Is, experts, topk, E4, mode=mode)
    for kind, seed in (("skewed", 31), ("empty", 32)):
        q = [_quantize(torch.randn(m, hidden, generator=_gen(seed * 1000 + pe), device="cuda"), 1) for pe in range(W)]
        ids, wts = routing_inputs(rt, m, experts, topk, kind, seed)
        w1 = torch.randn(experts, inter, hidden, generator=_gen(seed + 1), device="cuda") * hidden ** -0.5
        w1_8, s1, w1d = _quantize(w1[:, me * Is:(me + 1) * Is], 2)
        w2 = torch.randn(experts, hidden, inter, generator=_gen(seed + 2), device="cuda") * inter ** -0.5
        s2 = (w2[:, :, me * Is:(me + 1) * Is].abs().amax(dim=(1, 2)) / 448.0).float()
        w2_8 = (w2[:, :, me * Is:(me + 1) * Is] / s2[:, None, None]).to(E4).contiguous()
        if ag.ag is not None:
            ag.ag.gather.view(torch.uint8).fill_(0x7F)  # (e4m3 NaN bytes)
        y, r = ag(q[me][0], ids[me], w1_8.contiguous(), topk_weights=wts[me], scale=q[me][1], w_scale=s1.contiguous())
        h8, sh, hd = _quantize(torch.nn.functional.silu(y.float()), 1)
        out = rs(h8, w2_8, r, scale=sh, w_scale=s2)
        # the reference: the sum over PEs of each PE's dequantized down projection of its own quantized h (the
        # shards travel over the host), combined with the router weights
        xd = torch.cat([t[2] for t in q])
        all_ids, all_w = torch.cat(ids), torch.cat(wts)
        hs = rt.host.allgather((hd.cpu(), r.perm.cpu(), w1d.cpu(), (w2_8.double() * s2.double()[:, None, None]).cpu()))
        ref = torch.zeros(W * m, hidden, dtype=torch.float64)
        for h_pe, perm_pe, _, w2d_pe in hs:
            t = perm_pe // topk
            e = all_ids.reshape(-1).cpu()[perm_pe]
            contrib = torch.einsum("rk,rnk->rn", h_pe, w2d_pe[e]) * all_w.reshape(-1).cpu().double()[perm_pe][:, None]
            ref.index_add_(0, t, contrib)
        err = rel_err(out, ref[me * m:(me + 1) * m].cuda())
        assert out.dtype == torch.bfloat16 and err < 2e-2, (mode, kind, err)
        # and the up projection alone, this PE's shard, against the dequantized operands
        ref_y = torch.einsum("rk,rnk->rn", xd[r.rows], w1d[all_ids.reshape(-1)[r.perm]])
        assert rel_err(y, ref_y) < 2e-2, (mode, kind, rel_err(y, ref_y))


@check("moe")
def moe_graph_replays(rt):
    """Both ops captured once in a CUDA graph (check_ids=False: no host sync), replayed on fresh tokens and
    routing copied into the captured inputs; decomposed, then pipelined (capture's first, uncaptured call makes the
    pipelined down projection's tile tables)."""
    for mode in ("decomposed", "pipelined"):
        _graph_replays(rt, mode)


def _graph_replays(rt, mode):
    W, me, m, hidden, inter, experts, topk = rt.world_size, rt.rank, 64, 128, 256, 8, 2
    w1 = expert_weights(experts, inter, hidden, "nk", 11)
    w2 = expert_weights(experts, hidden, inter, "nk", 12)
    w1s, w2s = shard(w1, "nk", 1, me, W), shard(w2, "nk", 2, me, W)
    ag = flux_shmem.AllGatherGroupGEMM(W * m, hidden, inter // W, experts, topk, mode=mode)
    rs = flux_shmem.GroupGEMMReduceScatter(W * m, hidden, inter // W, experts, topk, mode=mode)
    x = torch.empty(m, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(m, topk, device="cuda", dtype=torch.int64)
    wts = torch.zeros(m, topk, device="cuda")

    def step():
        y, r = ag(x, ids, w1s, topk_weights=wts, check_ids=False)
        return rs(torch.nn.functional.silu(y.float()).to(torch.bfloat16), w2s, r)

    def load(seed):
        xs = [torch.randn(m, hidden, generator=_gen(seed * 1000 + pe), device="cuda").to(torch.bfloat16)
              for pe in range(W)]
        i, w = routing_inputs(rt, m, experts, topk, "skewed" if seed % 2 else "balanced", seed)
        x.copy_(xs[me]), ids.copy_(i[me]), wts.copy_(w[me])
        return reference(torch.cat(xs), torch.cat(i), torch.cat(w), w1, w2, "nk")[me * m:(me + 1) * m]

    load(20)
    g, out = capture(step)
    for seed in (21, 22, 23):
        ref = load(seed)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        assert err < 1e-2, (mode, seed, err)


@check("moe")
def moe_bad_ids_raise_on_every_pe(rt):
    """The last PE's router names expert E: every PE raises, naming that PE (the ids are gathered first, so all
    PEs check the same values), and the ops work again afterwards; decomposed and pipelined (whose token gather
    is already under way when the ids are checked)."""
    for mode in ("decomposed", "pipelined"):
        _bad_ids(rt, mode)


def _bad_ids(rt, mode):
    W, me, m, experts, topk = rt.world_size, rt.rank, 32, 8, 2
    ag = flux_shmem.AllGatherGroupGEMM(W * m, 128, 64, experts, topk, mode=mode)
    x = torch.randn(m, 128, device="cuda").to(torch.bfloat16)
    w1 = (torch.randn(experts, 64, 128, generator=_gen(61), device="cuda") * 0.1).to(torch.bfloat16)
    ids = torch.randint(0, experts, (m, topk), device="cuda")
    bad = ids.clone()
    if me == W - 1:
        bad[5, 1] = experts
    try:
        ag(x, bad, w1)
    except ValueError as e:
        assert f"expert id {experts} at token {(W - 1) * m + 5} slot 1 (PE {W - 1}'s shard row 5)" in str(e), e
    else:
        raise AssertionError("no error for an expert id out of range")
    # the next call gathers fresh tokens (not the failed call's, still in the buffer): against their product
    xs = [torch.randn(m, 128, generator=_gen(62 + pe), device="cuda").to(torch.bfloat16) for pe in range(W)]
    torch.cuda.synchronize()
    rt.host.barrier()
    if ag.ag is not None:
        ag.ag.gather.fill_(float("nan"))
    torch.cuda.synchronize()
    rt.host.barrier()
    y, r = ag(xs[me], ids, w1)
    ref = torch.einsum("rk,rnk->rn", torch.cat(xs)[r.rows].double(),
                       w1.double()[r.ids.reshape(-1)[r.perm]])
    assert rel_err(y, ref) < 1e-2, (mode, rel_err(y, ref))


@check("moe")
def moe_layer_gradients(rt):
    """flux_shmem.nn.MoE forward and backward against an fp64 autograd reference of the whole block: the output
    and x's gradient (this PE's tokens), each weight shard's gradient, and the router's (summed over PEs: each PE's
    is its own tokens' part); then torch.compile(fullgraph=True) of the module against eager; and the same
    gradients with parallel='ep' (each PE its whole experts)."""
    _layer_gradients(rt, "tp")
    _layer_gradients(rt, "ep")


def _layer_gradients(rt, parallel):
    from flux_shmem.nn.moe import MoE
    W, me, m, hidden, inter, experts, topk = rt.world_size, rt.rank, 48, 128, 256, 8, 2
    Is = inter // W
    block = MoE(hidden, inter, experts, topk, max_tokens=W * m, parallel=parallel)
    g0 = _gen(77)
    wr = torch.randn(experts, hidden, generator=g0, device="cuda") * 0.3
    gate = torch.randn(experts, inter, hidden, generator=g0, device="cuda") * hidden ** -0.5
    up = torch.randn(experts, inter, hidden, generator=g0, device="cuda") * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=g0, device="cuda") * inter ** -0.5
    el = experts // W
    # (TP: a slice of every expert's intermediate size; EP: this PE's whole experts)
    mine, ex = (slice(me * Is, (me + 1) * Is), slice(None)) if parallel == "tp" else \
        (slice(None), slice(me * el, (me + 1) * el))
    with torch.no_grad():
        block.router.weight.copy_(wr)
        block.w_gate_up.copy_(torch.cat([gate[ex, mine], up[ex, mine]], dim=1))
        block.w_down.copy_(down[ex, :, mine])
    xs = [torch.randn(m, hidden, generator=_gen(300 + pe), device="cuda").to(torch.bfloat16) for pe in range(W)]
    gs = [torch.randn(m, hidden, generator=_gen(400 + pe), device="cuda").to(torch.bfloat16) for pe in range(W)]
    x = xs[me].clone().requires_grad_()
    out = block(x)
    out.backward(gs[me])
    # the reference over every PE's tokens, with the experts each PE's router chose (bf16 logits can flip
    # near-ties against fp64's)
    ids = torch.cat([block.route(t)[0] for t in xs])
    ref_p = {k: v.detach().double().requires_grad_() for k, v in
             dict(wr=block.router.weight.float(), gate=gate.to(torch.bfloat16).float(),
                  up=up.to(torch.bfloat16).float(), down=down.to(torch.bfloat16).float()).items()}
    xd = torch.cat(xs).double().requires_grad_()
    probs = torch.softmax(xd @ ref_p["wr"].t(), dim=-1)
    wts = probs.gather(1, ids)
    wts = wts / wts.sum(-1, keepdim=True)
    ref = torch.zeros(W * m, hidden, dtype=torch.float64, device="cuda")
    for e in range(experts):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if len(t):
            h = torch.nn.functional.silu(xd[t] @ ref_p["gate"][e].t()) * (xd[t] @ ref_p["up"][e].t())
            ref = ref.index_add(0, t, (h @ ref_p["down"][e].t()) * wts[t, j][:, None])
    ref.backward(torch.cat(gs).double())
    rows = slice(me * m, (me + 1) * m)
    router_sum = sum(torch.from_numpy(a) for a in rt.host.allgather(block.router.weight.grad.float().cpu().numpy()))
    pairs = {"out": (out, ref[rows]), "x": (x.grad, xd.grad[rows]),
             "w_gate_up": (block.w_gate_up.grad, torch.cat([ref_p["gate"].grad[ex, mine], ref_p["up"].grad[ex, mine]],
                                                           1)),
             "w_down": (block.w_down.grad, ref_p["down"].grad[ex, :, mine]),
             "router": (router_sum.cuda(), ref_p["wr"].grad)}
    for name, (got, want) in pairs.items():
        err = rel_err(got.detach(), want.detach())
        assert err < 3e-2, (parallel, name, err)
    if parallel != "tp":
        return
    # torch.compile(fullgraph=True): the same output and gradients as eager
    eager = (out.detach(), x.grad.clone(), block.w_gate_up.grad.clone(), block.w_down.grad.clone())
    block.zero_grad(set_to_none=True)
    xc = xs[me].clone().requires_grad_()
    outc = torch.compile(block, fullgraph=True)(xc)
    outc.backward(gs[me])
    for name, a, b in zip(("out", "x", "w_gate_up", "w_down"), eager,
                          (outc.detach(), xc.grad, block.w_gate_up.grad, block.w_down.grad)):
        assert rel_err(b, a) < 1e-3, (name, rel_err(b, a))

