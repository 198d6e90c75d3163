"""Issue 38 (CPU): the MoE routing layout, the fused kernel's tile tables, the decomposed math against an fp64
reference, and the ops' argument checks. The ops run here as a job of one PE with CPU tensors (torch's grouped GEMM
has a CPU path); at several PEs they add our AllGather / ReduceScatter, checked on a GPU (tests/gpu/checks.py,
group moe)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flux_shmem
from flux_shmem.ops import moe
from flux_shmem.plan import costs
from flux_shmem.plan import inputs as plan_inputs
from flux_shmem.plan import moe as pmoe
from test_nn_layers import compile_recording

ROUTINGS = ("balanced", "skewed", "empty")


def make_ids(kind: str, m: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """[m, topk] distinct expert ids per token: uniform ('balanced'), most tokens to expert 0 and 1 ('skewed'), or
    never experts 1 and E - 1 ('empty')."""
    logits = torch.randn(m, experts, generator=gen)
    if kind == "skewed":
        logits[:, :2] += 4.0
    if kind == "empty":
        logits[:, [1, experts - 1]] = -1e9
    return torch.topk(logits, topk, dim=1).indices


# ------------------------------------------------------------------------------------------------------------
# The layout
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("m,experts,topk", [(1, 4, 1), (37, 8, 2), (256, 16, 4), (96, 64, 8)])
def test_every_token_row_reaches_exactly_its_experts(kind, m, experts, topk):
    gen = torch.Generator().manual_seed(m * experts + topk)
    ids = make_ids(kind, m, experts, topk, gen)
    r = pmoe.route(ids, experts)
    flat = ids.reshape(-1)
    assert sorted(r.perm.tolist()) == list(range(m * topk))                       # a permutation of the slots
    assert torch.equal(r.inverse[r.perm], torch.arange(m * topk))
    counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(r.counts(), counts) and r.offs.dtype == torch.int32
    lo = 0
    for e in range(experts):                                                      # expert e's rows: its pairs,
        hi = int(r.offs[e])                                                       # token order
        mine = r.perm[lo:hi]
        assert bool((flat[mine] == e).all()) and torch.equal(mine, torch.sort(mine).values)
        assert torch.equal(r.rows[lo:hi], mine // topk)
        lo = hi
    assert lo == m * topk
    perm, offs = pmoe.grouped_rows(ids.numpy(), experts)                          # the numpy mirror
    assert np.array_equal(perm, r.perm.numpy()) and np.array_equal(offs, r.offs.numpy())
    if kind == "empty" and experts > 2:
        assert int(counts[1]) == 0 and int(counts[-1]) == 0


def test_bad_ids_name_the_token_and_its_pe():
    ids = torch.tensor([[0, 1], [2, 3], [1, 8], [0, 2]])
    with pytest.raises(ValueError, match=r"expert id 8 at token 2 slot 1 \(PE 1's shard row 0\) is outside "
                                         r"\[0, 8\)"):
        pmoe.check_ids(ids, 8, 2)
    with pytest.raises(ValueError, match="expert id -1"):
        pmoe.check_ids(torch.tensor([[0, -1]]), 8, 1)
    pmoe.check_ids(ids.clamp(max=7), 8, 2)


@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_tiles_stay_inside_experts_and_wait_on_exactly_what_they_read(kind, tile_m):
    world, shard, chunk_rows, experts, topk = 4, 96, 32, 8, 2
    gen = torch.Generator().manual_seed(tile_m)
    ids = make_ids(kind, world * shard, experts, topk, gen).numpy()
    perm, offs = pmoe.grouped_rows(ids, experts)
    tiles = pmoe.group_tiles(offs, tile_m)
    starts = np.concatenate([[0], offs[:-1]])
    covered = np.zeros(len(perm), dtype=int)
    for e, r0, n in tiles:
        assert 0 < n <= tile_m and starts[e] <= r0 and r0 + n <= offs[e]          # never across experts
        covered[r0:r0 + n] += 1
    assert (covered == 1).all()                                                    # every grouped row once
    assert sorted(set(tiles[:, 0])) == [e for e in range(experts) if offs[e] > starts[e]]
    assert len(tiles) == sum(-(-(hi - lo) // tile_m) for lo, hi in zip(starts, offs))
    token_rows = perm // topk
    woff, wch = pmoe.tile_waits(tiles, token_rows, shard, chunk_rows)
    per_shard = -(-shard // chunk_rows)
    assert len(woff) == len(tiles) + 1 and woff[-1] == len(wch)
    for i, (_, r0, n) in enumerate(tiles):
        want = {int(t // shard) * per_shard + int(t % shard) // chunk_rows for t in token_rows[r0:r0 + n]}
        got = wch[woff[i]:woff[i + 1]]
        assert list(got) == sorted(want)                                           # exactly its rows' chunks
    for pe in range(world):
        order = pmoe.tile_order(woff, wch, pe, world, per_shard)
        assert sorted(order) == list(range(len(tiles)))
        last = [max(((c // per_shard - pe) % world) * per_shard + c % per_shard for c in wch[woff[i]:woff[i + 1]])
                for i in order]
        assert last == sorted(last)                                                # by last arrival


# ------------------------------------------------------------------------------------------------------------
# The decomposed math against fp64
def reference(x, ids, weights, w1, w2, layout, b1=None, b2=None):
    """fp64: out[t] = sum_j weights[t, j] * (act(x[t] @ W1[e]^T + b1[e]) @ W2[e]^T + b2[e]), e = ids[t, j]."""
    x, weights = x.double(), weights.double()
    out = torch.zeros(x.shape[0], w2.shape[1] if layout == "nk" else w2.shape[2], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a = w1[e].double() if layout == "nk" else w1[e].double().t()
            b = w2[e].double() if layout == "nk" else w2[e].double().t()
            h = x[t] @ a.t() + (b1[e].double() if b1 is not None else 0)
            out[t] += weights[t, j] * (torch.nn.functional.silu(h) @ b.t() + (b2[e].double() if b2 is not None else 0))
    return out


def weights_for(layout, experts, n, k, gen, scale):
    w = torch.randn(experts, n, k, generator=gen) * scale
    return (w if layout == "nk" else w.transpose(1, 2).contiguous()).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_grouped_mm_and_combine_match_fp64(kind, layout):
    gen = torch.Generator().manual_seed(7)
    m, hidden, inter, experts, topk = 48, 64, 32, 8, 2
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16)
    ids = make_ids(kind, m, experts, topk, gen)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), dim=1)
    w1, w2 = weights_for(layout, experts, inter, hidden, gen, 0.1), weights_for(layout, experts, hidden, inter, gen, 0.1)
    r = pmoe.route(ids, experts, wts)
    y = moe.grouped_mm(x.index_select(0, r.rows), w1, r.offs, layout)
    h = torch.nn.functional.silu(y.float()).to(torch.bfloat16)
    out = moe.combine(moe.grouped_mm(h, w2, r.offs, layout), r, r.weights)
    ref = reference(x, ids, wts, w1, w2, layout)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert out.shape == (m, hidden) and out.dtype == torch.bfloat16 and err < 2e-2, float(err)


# ------------------------------------------------------------------------------------------------------------
# The ops at one PE (CPU tensors: the `one_pe` fixture of conftest.py) and their argument checks
@pytest.mark.parametrize("mode", ["auto", "pipelined"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_one_pe_block_matches_fp64_with_biases(one_pe, layout, mode):
    gen = torch.Generator().manual_seed(11)
    m, hidden, inter, experts, topk = 40, 48, 24, 6, 2
    ag = flux_shmem.AllGatherGroupGEMM(m, hidden, inter, experts, topk, layout=layout, mode=mode)
    rs = flux_shmem.GroupGEMMReduceScatter(m, hidden, inter, experts, topk, layout=layout, mode=mode)
    assert "one PE" in repr(ag) and "one PE" in repr(rs)
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16)
    ids = make_ids("empty", m, experts, topk, gen).to(torch.int32)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), dim=1)
    w1, w2 = weights_for(layout, experts, inter, hidden, gen, 0.1), weights_for(layout, experts, hidden, inter, gen, 0.1)
    b1 = (torch.randn(experts, inter, generator=gen) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(experts, hidden, generator=gen) * 0.1).to(torch.bfloat16)
    y, r = ag(x, ids, w1, topk_weights=wts, bias=b1)
    assert y.shape == (m * topk, inter) and r.tokens == m and r.topk == topk
    out = rs(torch.nn.functional.silu(y.float()).to(torch.bfloat16), w2, r, bias=b2)
    ref = reference(x, ids, wts, w1, w2, layout, b1, b2)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert out.shape == (m, hidden) and err < 2e-2, float(err)


def test_construction_errors_name_the_fix(one_pe):
    cases = [
        (dict(topk=9), ValueError, "topk=9 exceeds num_experts=8"),
        (dict(dtype=torch.float16), TypeError, "take bfloat16"),
        (dict(dtype=torch.float8_e5m2), TypeError, "cast to torch.float8_e4m3fn"),
        (dict(dtype=torch.float8_e4m3fn, layout="kn"), ValueError, "fp8 experts take 'nk' weights"),
        (dict(dtype=torch.float8_e4m3fn, inter=40), ValueError, "inter=40 must be a multiple of 16"),
        (dict(hidden=60), ValueError, "hidden=60 must be a multiple of 8"),
        (dict(layout="mk"), ValueError, "layout must be one of"),
        (dict(mode="fused"), NotImplementedError, "fused grouped kernel is not built yet"),
        (dict(max_m=0), ValueError, "max_m must be a positive integer"),
    ]
    base = dict(max_m=64, hidden=64, inter=32, num_experts=8, topk=2)
    for op in (flux_shmem.AllGatherGroupGEMM, flux_shmem.GroupGEMMReduceScatter):
        for change, err, needle in cases:
            kw = {**base, **change}
            with pytest.raises(err, match=needle):
                op(kw.pop("max_m"), kw.pop("hidden"), kw.pop("inter"), kw.pop("num_experts"), kw.pop("topk"), **kw)


def test_call_errors_name_the_fix(one_pe):
    gen = torch.Generator().manual_seed(3)
    m, hidden, inter, experts, topk = 16, 32, 16, 4, 2
    ag = flux_shmem.AllGatherGroupGEMM(m, hidden, inter, experts, topk)
    rs = flux_shmem.GroupGEMMReduceScatter(m, hidden, inter, experts, topk)
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16)
    ids = make_ids("balanced", m, experts, topk, gen)
    w1 = weights_for("nk", experts, inter, hidden, gen, 0.1)
    w2 = weights_for("nk", experts, hidden, inter, gen, 0.1)
    with pytest.raises(ValueError, match=r"expert id 4 at token 0 slot 0"):
        ag(x, torch.full_like(ids, 4), w1)
    with pytest.raises(TypeError, match="int32 or int64"):
        ag(x, ids.float(), w1)
    with pytest.raises(ValueError, match=r"expected \(16, 2\)"):
        ag(x, ids[:, :1], w1)
    with pytest.raises(ValueError, match=r"takes \(4, 16, 32\)"):
        ag(x, ids, w2)
    with pytest.raises(ValueError, match="the op takes 1..16 per PE"):
        ag(torch.cat([x, x]), torch.cat([ids, ids]), w1)
    y, r = ag(x, ids, w1)                                   # no weights: the combine then needs them
    with pytest.raises(ValueError, match="no combine weights"):
        rs(y, w2, r)
    with pytest.raises(ValueError, match=r"expected \(32, 16\)"):
        rs(y[:8], w2, r, topk_weights=torch.ones(m, topk))
    with pytest.raises(TypeError, match="the Routing that AllGatherGroupGEMM returned"):
        rs(y, w2, (r.perm, r.offs), topk_weights=torch.ones(m, topk))
    other = flux_shmem.GroupGEMMReduceScatter(m, hidden, inter, experts + 1, topk)
    with pytest.raises(ValueError, match="routing is for 4 experts, top-2; this op was built for 5"):
        other(y, weights_for("nk", experts + 1, hidden, inter, gen, 0.1), r, topk_weights=torch.ones(m, topk))
    out = rs(y, w2, r, topk_weights=torch.ones(m, topk))
    assert out.shape == (m, hidden) and torch.isfinite(out.float()).all()


# ------------------------------------------------------------------------------------------------------------
# flux_shmem.nn.MoE at one PE: forward and every gradient against fp64 autograd
def test_nn_moe_forward_and_gradients_match_fp64(one_pe):
    from flux_shmem.nn.moe import MoE
    torch.manual_seed(5)
    m, hidden, inter, experts, topk = 48, 64, 32, 8, 2
    block = MoE(hidden, inter, experts, topk, max_tokens=m, device="cpu")
    with torch.no_grad():
        block.router.weight.normal_(0, 0.5)
    x = torch.randn(m, hidden).to(torch.bfloat16).requires_grad_()
    out = block(x)
    g = torch.randn(m, hidden).to(torch.bfloat16)
    out.backward(g)
    ids, _ = block.route(x.detach())
    assert (torch.bincount(ids.reshape(-1), minlength=experts) > 0).sum() >= 4  # (several experts in use)

    # the reference: the same block in fp64, the same experts chosen
    xd = x.detach().double().requires_grad_()
    wr = block.router.weight.detach().double().requires_grad_()
    w1 = block.w_gate_up.detach().double().requires_grad_()
    w2 = block.w_down.detach().double().requires_grad_()
    probs = torch.softmax(xd @ wr.t(), dim=-1)
    wts = probs.gather(1, ids)
    wts = wts / wts.sum(-1, keepdim=True)
    ref = torch.zeros(m, hidden, dtype=torch.float64)
    for t in range(m):
        for j in range(topk):
            e = int(ids[t, j])
            gate, up = (xd[t] @ w1[e].t()).split(inter, dim=0)
            ref = ref.index_add(0, torch.tensor([t]), (wts[t, j] * ((F.silu(gate) * up) @ w2[e].t()))[None])
    ref.backward(g.double())

    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())
    assert rel(out, ref) < 2e-2, rel(out, ref)
    for name, got, want in (("x", x.grad, xd.grad), ("router", block.router.weight.grad, wr.grad),
                            ("w_gate_up", block.w_gate_up.grad, w1.grad), ("w_down", block.w_down.grad, w2.grad)):
        assert got is not None and got.shape == want.shape, name
        assert rel(got, want) < 3e-2, (name, rel(got, want))


def test_routing_travels_bit_exact_in_one_gather(one_pe):
    """The ids and the router weights share one gather of int32 words (the weights' fp32 bits): a stand-in gather
    of two PEs' rows returns both exactly, tiny and odd weights included."""
    ag = flux_shmem.AllGatherGroupGEMM(16, 32, 16, 300, 3)
    assert ag._route_cols == 8  # (2 x topk words, padded to 16-byte rows)
    other = torch.tensor([[299, 0, 7]] * 8)
    seen = []

    def gather(t, copy=True):   # PE 0 (this one), then a peer whose rows are `other` and its weights
        assert t.dtype == torch.float32 and t.shape == (8, 8)
        peer = torch.zeros(8, 8, dtype=torch.int32)
        peer[:, :3] = other
        peer[:, 3:6] = torch.full((8, 3), 0.25).view(torch.int32)
        seen.append(t)
        return torch.cat([t, peer.view(torch.float32)])
    ag.route_ag = gather
    ids = torch.tensor([[1, 2, 3]] * 8, dtype=torch.int32)
    wts = torch.tensor([[1e-40, float.fromhex("0x1.fffffep-1"), 3.0]] * 8)
    got_ids, got_w, got_s = ag.gather_routing(ids, wts)
    assert got_s is None
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, torch.cat([ids.long(), other]))
    assert torch.equal(got_w[:8].view(torch.int32), wts.view(torch.int32))      # bit for bit
    assert torch.equal(got_w[8:], torch.full((8, 3), 0.25))
    assert len(seen) == 1


def test_nn_moe_compiles_fullgraph_and_its_ops_pass_opcheck(one_pe):
    """torch.compile(fullgraph=True) of the block (dynamo and AOTAutograd over the custom ops' fake kernels): one
    forward and one backward graph, each op once, the compiled output and gradients equal to eager; opcheck of
    the four custom ops (fake kernels, schema, autograd registration)."""
    from flux_shmem.nn.moe import MoE
    torch.manual_seed(9)
    m, hidden, inter, experts, topk = 32, 64, 32, 8, 2
    block = MoE(hidden, inter, experts, topk, max_tokens=m, device="cpu", check_ids=False)
    x0 = torch.randn(m, hidden).to(torch.bfloat16)
    g = torch.randn(m, hidden).to(torch.bfloat16)
    compiled, graphs = compile_recording(block)
    outs = []
    for fn in (block, compiled):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = fn(x)
        y.backward(g)
        outs.append((y.detach(), x.grad, [p.grad.clone() for p in block.parameters()]))
    (y0, gx0, p0), (y1, gx1, p1) = outs
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    fw, bw = graphs
    ops_of = [[str(n.target) for n in gr.graph.nodes if n.op == "call_function"] for gr in (fw, bw)]
    assert ops_of[0].count("flux_shmem.moe_up.default") == 1 and ops_of[0].count("flux_shmem.moe_down.default") == 1
    assert ops_of[1].count("flux_shmem.moe_up_backward.default") == 1
    assert ops_of[1].count("flux_shmem.moe_down_backward.default") == 1
    # opcheck on real inputs of each op
    x = x0.clone().requires_grad_()
    ids, weights = block.route(x.detach())
    w1, w2 = block.w_gate_up.detach().requires_grad_(), block.w_down.detach().requires_grad_()
    h = block._handle
    up_args = (x, w1, ids, weights.detach(), h, 1, experts, False)
    torch.library.opcheck(torch.ops.flux_shmem.moe_up.default, up_args)
    y, perm, inverse, offs, all_ids, all_w, xs = torch.ops.flux_shmem.moe_up(*up_args)
    hh = y.detach()[:, :inter].contiguous().requires_grad_()
    down_args = (hh, w2, weights.detach().requires_grad_(), perm, inverse, offs, all_ids, all_w, h, 1)
    torch.library.opcheck(torch.ops.flux_shmem.moe_down.default, down_args)
    out, partial = torch.ops.flux_shmem.moe_down(*down_args)
    for local in (None, torch.rand(all_ids.shape, generator=torch.Generator().manual_seed(2)) < 0.5):  # (TP, EP)
        torch.library.opcheck(torch.ops.flux_shmem.moe_up_backward.default,
                              (y.detach(), w1.detach(), xs.detach(), inverse, offs, local, h, 1, topk))
        torch.library.opcheck(torch.ops.flux_shmem.moe_down_backward.default,
                              (g, hh.detach(), w2.detach(), partial.detach(), perm, inverse, offs, all_w.detach(),
                               local, h, 1, topk))


# ------------------------------------------------------------------------------------------------------------
# The fused op's model (plan.moe.fused_estimate)
def test_grouped_span_whole_waves_and_ready_order_is_best():
    gemm = costs.Gemm(tile_us=10.0)
    assert pmoe.grouped_span(np.zeros(7), np.full(7, 128), 3, 4, gemm) == 60.0      # 21 items on 4: 6 waves
    assert pmoe.grouped_span(np.array([0.0, 100.0]), np.full(2, 128), 2, 8, gemm) == 110.0
    rng = np.random.default_rng(1)
    for _ in range(200):   # unit-time items with release times: earliest-ready first is optimal (list scheduling)
        n = int(rng.integers(1, 30))
        ready = rng.uniform(0, 200, n)
        args = (ready, np.full(n, 128), int(rng.integers(1, 5)), int(rng.integers(1, 9)), gemm)
        by_ready = pmoe.grouped_span(*args, order=np.argsort(ready, kind="stable"))
        assert by_ready <= pmoe.grouped_span(*args) + 1e-9
        assert by_ready <= pmoe.grouped_span(*args, order=rng.permutation(n)) + 1e-9


@pytest.mark.parametrize("kind", ROUTINGS)
def test_fused_estimate_is_bounded_by_its_parts(kind):
    gen = torch.Generator().manual_seed(4)
    world, m, hidden, n, experts, topk = 4, 2048, 2048, 512, 16, 2
    ids = make_ids(kind, world * m, experts, topk, gen).numpy()
    gemm = plan_inputs.gemm_model(hidden, n=n)
    links = costs.emulated_links(87.3, 1.5)
    for pe in (0, 3):
        for blocks in (2, 8, 16):
            est = pmoe.fused_estimate(ids, experts, world=world, node_size=world, pe=pe, hidden=hidden, n=n,
                                      elem_bytes=2, gemm=gemm, sms=132, comm_blocks=blocks, chunk_rows=64,
                                      links=links)
            slower = pmoe.grouped_span(np.zeros(1), np.array([128]), 1, 1, gemm)  # (one tile's time)
            assert est.decomposed_us == pytest.approx(est.comm_us + est.gemm_us)
            assert est.fused_us >= est.gemm_us - 1e-6 and est.fused_us >= slower
            assert 0.0 <= est.hidden <= 1.0
    # links all but instant (chunks land within microseconds): the fused GEMM is the grouped GEMM on the SMs beside
    # the comm kernel, plus at most the wait for the last chunk
    instant = dataclasses.replace(costs.Links(), nvlink_gbps=1e9, block_gbps=1e9, local_gbps=1e9,
                                  nvlink_latency_us=0.0)
    est = pmoe.fused_estimate(ids, experts, world=world, node_size=world, pe=0, hidden=hidden, n=n, elem_bytes=2,
                              gemm=gemm, sms=132, comm_blocks=4, chunk_rows=64, links=instant)
    perm, offs = pmoe.grouped_rows(ids, experts)
    tiles = pmoe.group_tiles(offs, gemm.tile_m)
    alone = pmoe.grouped_span(np.zeros(len(tiles)), tiles[:, 2], -(-n // gemm.tile_n), 64,
                              gemm.beside_comm(instant))
    assert alone <= est.fused_us <= alone + est.comm_us + 1e-6, (alone, est)  # (waits only for the last arrival)



# ------------------------------------------------------------------------------------------------------------
# fp8 experts (e4m3 with fp32 scales): the one-PE block against the dequantized fp64 reference
def quantize(x: torch.Tensor, dim: int):
    """e4m3 values and fp32 scales along `dim` (amax / 448 per row / column), and the dequantized fp64 tensor."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12)
    scale = (amax / 448.0).float()
    q = (x / scale).to(torch.float8_e4m3fn)
    return q, scale.squeeze(dim), q.double() * scale.double()


@pytest.mark.parametrize("per_tensor", [False, True])
def test_one_pe_fp8_block_matches_the_dequantized_fp64_reference(one_pe, per_tensor):
    gen = torch.Generator().manual_seed(21)
    m, hidden, inter, experts, topk = 40, 64, 32, 6, 2
    E4 = torch.float8_e4m3fn
    ag = flux_shmem.AllGatherGroupGEMM(m, hidden, inter, experts, topk, E4)
    rs = flux_shmem.GroupGEMMReduceScatter(m, hidden, inter, experts, topk, E4)
    x = torch.randn(m, hidden, generator=gen)
    if per_tensor:
        sx = (x.abs().max() / 448.0).float()
        x8, xd = (x / sx).to(E4), (x / sx).to(E4).double() * float(sx)
    else:
        x8, sx, xd = quantize(x, 1)
    w1 = torch.randn(experts, inter, hidden, generator=gen) * 0.1
    w1_8, s1, w1d = quantize(w1, 2)                                    # [E, inter] scales: per output column
    ids = make_ids("empty", m, experts, topk, gen)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), dim=1)
    y, r = ag(x8, ids, w1_8, topk_weights=wts, scale=sx, w_scale=s1)
    assert y.dtype == torch.bfloat16 and y.shape == (m * topk, inter)
    ref_y = torch.stack([xd[t] @ w1d[int(e)].t() for t, e in zip(r.rows.tolist(), r.ids.reshape(-1)[r.perm])])
    assert float((y.double() - ref_y).norm() / ref_y.norm()) < 1e-2
    h = torch.nn.functional.silu(y.float())
    h8, sh, hd = quantize(h, 1)                                        # per grouped row
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    s2 = (w2.abs().amax(dim=(1, 2)) / 448.0).float()                   # [E]: one per expert
    w2_8 = (w2 / s2[:, None, None]).to(E4)
    w2d = w2_8.double() * s2.double()[:, None, None]
    out = rs(h8, w2_8, r, scale=sh, w_scale=s2)
    ref = torch.zeros(m, hidden, dtype=torch.float64)
    for row, (t, e) in enumerate(zip(r.rows.tolist(), r.ids.reshape(-1)[r.perm].tolist())):
        j = int(r.perm[row]) % topk
        ref[t] += float(wts[t, j]) * (hd[row] @ w2d[e].t())
    assert out.dtype == torch.bfloat16 and float((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_fp8_scale_errors_name_the_fix(one_pe):
    E4 = torch.float8_e4m3fn
    ag = flux_shmem.AllGatherGroupGEMM(16, 32, 16, 4, 2, E4)
    x8 = torch.randn(16, 32).to(E4)
    w8 = torch.randn(4, 16, 32).to(E4)
    ids = torch.zeros(16, 2, dtype=torch.int64)
    ids[:, 1] = 1
    with pytest.raises(ValueError, match="fp8 experts need scale"):
        ag(x8, ids, w8)
    with pytest.raises(ValueError, match=r"scale has shape \(15,\)"):
        ag(x8, ids, w8, scale=torch.ones(15), w_scale=torch.ones(4))
    with pytest.raises(ValueError, match=r"w_scale has shape \(4, 15\)"):
        ag(x8, ids, w8, scale=torch.ones(16), w_scale=torch.ones(4, 15))
    with pytest.raises(TypeError, match="w_scale must be a float32 tensor"):
        ag(x8, ids, w8, scale=torch.ones(16), w_scale=torch.ones(4, dtype=torch.float64))
    bf = flux_shmem.AllGatherGroupGEMM(16, 32, 16, 4, 2)
    with pytest.raises(ValueError, match="scales were given to a torch.bfloat16 op"):
        bf(x8.float().to(torch.bfloat16), ids, w8.float().to(torch.bfloat16), scale=torch.ones(16))
    y, _ = ag(x8, ids, w8, scale=torch.tensor(0.5), w_scale=torch.ones(4))     # a per-tensor scale
    want = (x8.float() * 0.5) @ w8[0].float().t()
    assert torch.allclose(y[:16].float(), want, rtol=2e-2, atol=1e-2)          # (expert 0's rows: tokens in order)


def test_fp8_token_scales_travel_with_the_routing(one_pe):
    """fp8: each token's scale is one more int32 word of the routing gather (a stand-in gather of two PEs)."""
    ag = flux_shmem.AllGatherGroupGEMM(16, 32, 16, 4, 2, torch.float8_e4m3fn)
    assert ag._route_cols == 8  # (2 x topk + 1 words, padded to 16-byte rows)

    def gather(t, copy=True):   # this PE, then a peer whose rows repeat this PE's with the scale doubled
        peer = t.view(torch.int32).clone()
        peer[:, 4] = (peer[:, 4].view(torch.float32) * 2).view(torch.int32)
        return torch.cat([t, peer.view(torch.float32)])
    ag.route_ag = gather
    ids = torch.tensor([[0, 3]] * 8)
    scales = torch.linspace(0.01, 3.0, 8)
    got_ids, got_w, got_s = ag.gather_routing(ids, None, scales)
    assert got_w is None and torch.equal(got_ids, torch.cat([ids, ids]))
    assert torch.equal(got_s, torch.cat([scales, scales * 2]))
