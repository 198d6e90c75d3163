"""Issue 38 (CPU): the MoE ops' other row layouts. Blocked (mode 'pipelined': block s = chunk s of every PE's
shard, expert by expert) and expert parallel (parallel='ep': this PE's whole experts first, the other PEs' slots
masked in the combine), against the one-block layout and fp64; the chunked reduce-scatter's step order and the
chunk-major all-gather."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flux_shmem
from flux_shmem.ops import moe
from flux_shmem.plan import moe as pmoe
from flux_shmem.plan import schedules as sch
from test_moe import ROUTINGS, make_ids, reference, weights_for


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("world,shard,chunk", [(4, 10, 3), (2, 96, 24), (3, 7, 7), (1, 33, 8), (8, 5, 1)])
def test_blocked_layout_holds_each_chunk_of_every_shard(kind, world, shard, chunk):
    """The pipelined ops' layout: block s = the pairs of tokens [s c, (s + 1) c) of every PE's shard, expert by
    expert, token order inside an expert; each block's ends relative to its first row; the numpy mirror agrees."""
    experts, topk = 8, 2
    gen = torch.Generator().manual_seed(world * 100 + shard + chunk)
    ids = make_ids(kind, world * shard, experts, topk, gen)
    r = pmoe.route(ids, experts, shard_tokens=shard, chunk_tokens=chunk)
    blocks = -(-shard // chunk)
    assert r.blocked == (blocks > 1) and len(r.blocks()) == blocks
    assert torch.equal(torch.sort(r.perm).values, torch.arange(world * shard * topk))
    assert torch.equal(r.inverse[r.perm], torch.arange(world * shard * topk))
    assert torch.equal(r.counts(), torch.bincount(ids.reshape(-1), minlength=experts))
    flat = ids.reshape(-1)
    end = 0
    for s, (lo, hi, t0, t1) in enumerate(r.blocks()):
        want = (s * chunk, min(shard, (s + 1) * chunk)) if r.blocked else (0, world * shard)  # (one: all)
        assert lo == end and (t0, t1) == want and hi - lo == (world if r.blocked else 1) * (t1 - t0) * topk
        mine = r.perm[lo:hi]
        tok = mine // topk
        if r.blocked:
            assert bool(((tok % shard >= t0) & (tok % shard < t1)).all())              # the block's tokens only
        offs = r.block_offs(s)
        assert offs.dtype == torch.int32 and int(offs[-1]) == hi - lo
        a = 0
        for e in range(experts):                                                     # expert by expert, in order
            b = int(offs[e])
            assert bool((flat[mine[a:b]] == e).all()) and torch.equal(mine[a:b], torch.sort(mine[a:b]).values)
            a = b
        end = hi
    assert end == world * shard * topk
    perm, offs = pmoe.grouped_rows(ids.numpy(), experts, shard, chunk)
    assert np.array_equal(perm, r.perm.numpy()) and np.array_equal(offs, r.offs.numpy())


def test_blocked_layout_keeps_bad_ids_inside_their_block():
    """check_ids=False with an id out of range: its row is computed by no expert, and no block's ends leave the
    block (a grouped GEMM of a block never reads past it)."""
    ids = torch.tensor([[0, 1], [9, 2], [1, -1], [3, 0], [2, 1], [0, 3]])
    r = pmoe.route(ids, 4, shard_tokens=3, chunk_tokens=2)
    for s, (lo, hi, _, _) in enumerate(r.blocks()):
        offs = r.block_offs(s)
        assert bool((offs >= 0).all()) and int(offs[-1]) <= hi - lo
    assert int(r.counts().sum()) == ids.numel() - 2


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_blocked_products_and_block_combines_equal_the_one_block_path(one_pe, layout):
    """What the pipelined ops compute, on the CPU: the grouped GEMM block by block (`grouped`) and each block's
    combine into its rows of every segment (`combine_block`) give the one-block layout's results."""
    gen = torch.Generator().manual_seed(5)
    world, shard, chunk, hidden, inter, experts, topk = 3, 10, 4, 32, 16, 6, 2
    M = world * shard
    op = flux_shmem.GroupGEMMReduceScatter(M, hidden, inter, experts, topk, layout=layout)
    x = torch.randn(M, inter, generator=gen).to(torch.bfloat16)
    ids = make_ids("skewed", M, experts, topk, gen)
    wts = torch.softmax(torch.randn(M, topk, generator=gen), dim=1)
    w = weights_for(layout, experts, hidden, inter, gen, 0.1)
    one, blk = pmoe.route(ids, experts, wts), pmoe.route(ids, experts, wts, shard_tokens=shard, chunk_tokens=chunk)
    p_one = op.grouped(x.index_select(0, one.rows), w, one, None, None, hidden)
    p_blk = op.grouped(x.index_select(0, blk.rows), w, blk, None, None, hidden)
    assert torch.equal(p_one.index_select(0, one.inverse), p_blk.index_select(0, blk.inverse))  # same products
    addend = torch.full((world, shard, hidden), float("nan"), dtype=torch.bfloat16)
    for s, (lo, hi, t0, t1) in enumerate(blk.blocks()):
        addend[:, t0:t1] = moe.combine_block(p_blk[lo:hi], blk, blk.weights, s)
    assert torch.equal(addend.view(M, hidden), moe.combine(p_one, one, one.weights))


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_expert_parallel_parts_sum_to_the_block(kind, layout):
    """parallel='ep' as each of 4 PEs computes it (its 2 of 8 whole experts, with biases), on the CPU: the local
    layout holds exactly the pairs of this PE's experts first; each PE's combine (the other PEs' slots masked,
    though their rows are NaN here) summed over the PEs is the fp64 block."""
    gen = torch.Generator().manual_seed(13)
    world, m, hidden, inter, experts, topk = 4, 24, 32, 16, 8, 2
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16)
    ids = make_ids(kind, m, experts, topk, gen)
    wts = torch.softmax(torch.randn(m, topk, generator=gen), dim=1)
    w1, w2 = weights_for(layout, experts, inter, hidden, gen, 0.1), weights_for(layout, experts, hidden, inter, gen, 0.1)
    b1 = (torch.randn(experts, inter, generator=gen) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(experts, hidden, generator=gen) * 0.1).to(torch.bfloat16)
    total = torch.zeros(m, hidden, dtype=torch.float64)
    el = experts // world
    for pe in range(world):
        r = pmoe.route_local(ids, experts, pe * el, el, wts)
        flat = ids.reshape(-1)
        mine = (flat >= pe * el) & (flat < (pe + 1) * el)
        n_mine = int(mine.sum())
        assert int(r.offs[-1]) == n_mine
        assert torch.equal(r.counts(), torch.bincount(flat, minlength=experts)[pe * el:(pe + 1) * el])
        assert bool(mine[r.perm[:n_mine]].all()) and not bool(mine[r.perm[n_mine:]].any())
        assert torch.equal(r.local.reshape(-1), mine)
        y = moe.grouped_mm(x.index_select(0, r.rows), w1[pe * el:(pe + 1) * el], r.offs, layout)
        y[n_mine:] = float("nan")                                                    # rows no expert here computes
        y += b1[pe * el:(pe + 1) * el].index_select(0, moe.row_experts(r))
        h = torch.nn.functional.silu(y.float()).to(torch.bfloat16)
        partial = moe.grouped_mm(h, w2[pe * el:(pe + 1) * el], r.offs, layout)
        partial[n_mine:] = float("nan")
        partial += b2[pe * el:(pe + 1) * el].index_select(0, moe.row_experts(r))
        total += moe.combine(partial, r, r.weights).double()
    ref = reference(x, ids, wts, w1, w2, layout, b1, b2)
    err = (total - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, float(err)


def test_expert_parallel_construction_and_routing_errors(one_pe):
    with pytest.raises(ValueError, match="parallel must be one of"):
        flux_shmem.AllGatherGroupGEMM(64, 64, 32, 8, 2, parallel="dp")
    one_pe_ag = flux_shmem.AllGatherGroupGEMM(64, 64, 32, 8, 2, parallel="ep")       # one PE: every expert
    assert one_pe_ag.local_experts == 8 and "parallel='ep' (experts 0..7 here)" in repr(one_pe_ag)
    rs = flux_shmem.GroupGEMMReduceScatter(64, 64, 32, 8, 2)
    ids = torch.randint(0, 8, (64, 2))
    other = pmoe.route_local(ids, 8, 4, 4, torch.ones(64, 2))
    with pytest.raises(ValueError, match="routing groups experts 4..7; this op .parallel='tp'. holds experts 0..7"):
        rs(torch.zeros(128, 32, dtype=torch.bfloat16), weights_for("nk", 8, 64, 32, torch.Generator(), 0.1), other)


@pytest.mark.parametrize("m,seg,chunk,tile", [(40, 10, 3, 4), (96, 24, 6, 8), (64, 16, 16, 16), (30, 10, 4, 7),
                                              (12, 12, 5, 1)])
def test_chunk_steps_complete_each_tile_after_its_last_row(m, seg, chunk, tile):
    row_step = [(r % seg) // chunk for r in range(m)]
    step = sch.chunk_step_of_tiles(m, seg, chunk, tile)
    assert step == [max(row_step[t * tile:(t + 1) * tile]) for t in range(-(-m // tile))]
    order = sch.chunk_completion(m, seg, chunk, tile)
    assert sorted(order) == [(t, 0) for t in range(len(step))]
    assert [step[t] for t, _ in order] == sorted(step)
    with pytest.raises(ValueError, match="must divide m"):
        sch.chunk_step_of_tiles(m + 1, seg, chunk, tile)


@pytest.mark.parametrize("world,node", [(4, 4), (8, 4), (2, 1)])
def test_chunk_major_all_gather_sends_chunk_by_chunk(world, node):
    """The same units as the default order; my sends (puts and direct stores) chunk 0 to every destination
    first, then chunk 1, ..."""
    chunks = 3
    for me in range(world):
        default = sch.ag_units(me, world, node, chunks)
        major = sch.ag_units(me, world, node, chunks, chunk_major=True)
        assert sorted(default) == sorted(major)
        sends = [u.chunk for u in major if u.kind in (sch.PUT, sch.DIRECT)]
        assert sends == sorted(sends)
        assert [u for u in major if u.kind not in (sch.PUT, sch.DIRECT)] == \
            [u for u in default if u.kind not in (sch.PUT, sch.DIRECT)]
