"""The schedules of flux_shmem/ops/_schedule.py, which the kernels read as tables and the simulator runs: every
chunk reaches every PE exactly once along a path whose data is already there, in ring-shift order; reduce-scatter
items cover every unit exactly once per node, with the dependencies kept inside one block; tile orders are
permutations in the intended order; the C++ row arithmetic agrees with the Python twins."""
from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path

import pytest

from flux_shmem.plan import schedules as sch

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 8), (8, 4), (16, 8), (8, 1), (6, 3), (12, 4), (32, 16)]


@pytest.mark.parametrize("world,L", TOPOLOGIES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_all_gather_delivers_every_chunk_once(world, L, chunks):
    arrivals = collections.Counter()
    for pe in range(world):
        units = sch.ag_units(pe, world, L, chunks)
        accepts = [u for u in units if u.kind == sch.ACCEPT]
        units = [u for u in units if u.kind != sch.ACCEPT]
        assert len(units) == world * chunks
        # every chunk put to me from another node is accepted once, before it is forwarded
        assert sorted((u.src, u.chunk) for u in accepts) == sorted(
            (u.src, u.chunk) for q in range(world) for u in sch.ag_units(q, world, L, chunks)
            if u.kind == sch.PUT and u.dest == pe)
        full = sch.ag_units(pe, world, L, chunks)
        for a in accepts:
            fwd = [i for i, u in enumerate(full) if u.kind == sch.FORWARD and (u.src, u.chunk) == (a.src, a.chunk)]
            assert all(i > full.index(a) for i in fwd)
        have = {(pe, c) for c in range(chunks)}  # my own shard (source of direct stores)
        node = pe // L
        for u in units:
            arrivals[(u.src, u.dest, u.chunk)] += 1
            kind, dnode = sch.AG_KINDS[u.kind], u.dest // L
            if kind == "local":
                assert u.src == u.dest == pe
            elif kind == "put":  # across nodes, only to my own local index, from my own shard
                assert u.src == pe and dnode != node and u.dest % L == pe % L
            elif kind == "direct":
                assert u.src == pe and dnode == node and u.dest != pe
            else:  # forward: a shard that came over the network from my local index on another node
                assert u.src // L != node and u.src % L == pe % L and dnode == node and u.dest != pe
        kinds = [u.kind for u in units]
        assert kinds == sorted(kinds, key=[sch.LOCAL, sch.PUT, sch.DIRECT, sch.FORWARD].index)
        assert all(u.dest == pe for u in accepts)
        # ring shift: step i of the direct phase goes to PE me - i, whole shards in chunk order
        direct = [u for u in units if u.kind == sch.DIRECT]
        expect = [(node * L + (pe - i) % L, c) for i in range(1, L) for c in range(chunks)]
        assert [(u.dest, u.chunk) for u in direct] == expect
        del have
    assert arrivals == collections.Counter({(s, d, c): 1 for s in range(world) for d in range(world)
                                            for c in range(chunks)})


@pytest.mark.parametrize("world,L", TOPOLOGIES)
def test_all_gather_ring_shift_has_one_sender_per_receiver(world, L):
    """In step i of the direct phase every PE of a node sends to a different PE: no receiver takes two streams."""
    for node in range(world // L):
        for i in range(1, L):
            dests = [node * L + (pe - i) % L for pe in range(node * L, (node + 1) * L)]
            assert sorted(dests) == list(range(node * L, (node + 1) * L))


def test_round_robin_and_tables():
    per = sch.ag_plan(1, 4, 4, 2, 3)
    assert [len(b) for b in per] == [3, 3, 2]
    assert sum(per, []) != sch.ag_units(1, 4, 4, 2) and sorted(sum(per, [])) == sorted(sch.ag_units(1, 4, 4, 2))
    flat, off = sch.plan_table(per)
    assert off == [0, 3, 6, 8] and len(flat) == 32 and tuple(flat[:4]) == tuple(per[0][0])
    flat, off = sch.plan_table([[sch.RsItem(1, 2, 3)]])
    assert flat == [1, 2, 3, 0] and off == [0, 1]
    with pytest.raises(ValueError, match="blocks"):
        sch.round_robin([1], 0)
    with pytest.raises(ValueError, match="topology"):
        sch.ag_units(0, 6, 4, 1)


@pytest.mark.parametrize("world,rows,chunk_rows", [(1, 64, 64), (2, 100, 40), (4, 256, 64), (8, 7, 3), (3, 5, 8)])
def test_copy_engine_all_gather_plan(world, rows, chunk_rows):
    """Every PE's copy list on byte buffers: each PE's gather buffer ends up as the concatenation of the shards,
    every (shard, chunk) flag is raised exactly once on every PE, and only after its chunk's bytes; each PE fills
    its own buffer first, then ring-shifts its shard to me - 1, me - 2, ..."""
    row_bytes = 6
    chunks = -(-rows // chunk_rows)
    shards = [bytes((17 * s + i) % 251 for i in range(rows * row_bytes)) for s in range(world)]
    gather = [bytearray(world * rows * row_bytes) for _ in range(world)]
    written = [[0] * (world * rows * row_bytes) for _ in range(world)]
    raised = [[0] * (world * chunks) for _ in range(world)]
    for me in range(world):
        plan = sch.ag_ce_copies(me, world, rows, chunk_rows, row_bytes)
        assert len(plan) == world * chunks
        assert [cp.dest for cp in plan] == [(me - i) % world for i in range(world) for _ in range(chunks)]
        for cp in plan:
            src = shards[me][cp.src_offset:cp.src_offset + cp.nbytes]
            gather[cp.dest][cp.offset:cp.offset + cp.nbytes] = src
            for i in range(cp.offset, cp.offset + cp.nbytes):
                written[cp.dest][i] += 1
            r0 = cp.chunk * chunk_rows
            lo, hi = (me * rows + r0) * row_bytes, (me * rows + min(rows, r0 + chunk_rows)) * row_bytes
            assert all(written[cp.dest][i] == 1 for i in range(lo, hi))
            assert cp.flag == me * chunks + cp.chunk
            raised[cp.dest][cp.flag] += 1
    for pe in range(world):
        assert bytes(gather[pe]) == b"".join(shards)
        assert all(w == 1 for w in written[pe]) and all(f == 1 for f in raised[pe])
    with pytest.raises(ValueError, match="geometry"):
        sch.ag_ce_copies(0, 2, 0, 8, 16)


def test_tile_chunks_and_arrival_order():
    # shards of 100 rows, chunks of 40: tile 0 (rows 0-127) needs all of shard 0 and chunk 0 of shard 1
    assert sch.tile_chunks(0, 128, 400, 100, 40) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert sch.tile_chunks(3, 128, 400, 100, 40) == [(3, 2)]
    arr = {(s, c): 10.0 * ((s - 2) % 4) + c for s in range(4) for c in range(3)}  # PE 2's view: own shard first
    order = sch.ag_tile_order(400, 128, 100, 40, arr)
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 2  # rows 256-383: shards 2 and 3, the earliest
    ready = [max(arr[sc] for sc in sch.tile_chunks(t, 128, 400, 100, 40)) for t in order]
    assert ready == sorted(ready)


@pytest.mark.parametrize("world,L", TOPOLOGIES)
@pytest.mark.parametrize("m,tm", [(1024, 128), (8192, 128), (96, 128), (1000, 128)])
def test_rs_tile_order(world, L, m, tm):
    """One order for every PE of a node: other nodes' segments first, then the node's own, each phase
    interleaved by M-tile (tile t of every segment before tile t + 1)."""
    m = max(world, m // world * world)
    ms = m // world
    orders = [sch.rs_tile_order(me, world, L, m, tm) for me in range(world)]
    for me, order in enumerate(orders):
        assert sorted(order) == list(range(-(-m // tm)))
        phases = sch.rs_segment_phases(me, world, L)
        assert sorted(sum(phases, [])) == list(range(world))
        assert all(s // L != me // L for s in phases[0]) and all(s // L == me // L for s in phases[1])
        assert order == orders[me // L * L]  # the same on every PE of my node
        pos = {t: i for i, t in enumerate(order)}
        whole = {t: t * tm // ms for t in order if t * tm // ms == (min(m, (t + 1) * tm) - 1) // ms}
        remote = [pos[t] for t, s in whole.items() if s // L != me // L]
        local = [pos[t] for t, s in whole.items() if s // L == me // L]
        if remote and local:
            assert max(remote) < min(local)
        # interleaved: among whole tiles of my node's segments, the tile index inside its segment never decreases
        rel = [(t * tm - s * ms) // tm for t, s in sorted(whole.items(), key=lambda x: pos[x[0]]) if s // L == me // L]
        assert rel == sorted(rel)


@pytest.mark.parametrize("world,L", TOPOLOGIES)
@pytest.mark.parametrize("ms,ur,tm", [(128, 128, 128), (100, 32, 128), (1000, 8, 128), (7, 4, 128), (256, 1, 128)])
@pytest.mark.parametrize("n,tn,gt", [(64, None, None), (1000, 256, 2), (768, 256, 1)])
def test_rs_plan_covers_units(world, L, ms, ur, tm, n, tn, gt):
    m = ms * world
    nodes = world // L
    units = sch.rs_units(ms, ur, tm, n, tn, gt)
    summed = collections.Counter()   # (segment, unit) -> node-level sums (once per node)
    for pe in range(world):
        plan = sch.rs_plan(pe, world, L, m, units, blocks=5)
        items = [it for b in plan for it in b]
        for b in plan:  # FINALs after every NODE_SUM of their block, after their own unit's
            ops = [it.op for it in b]
            assert ops == sorted(ops)
            for i, it in enumerate(b):
                if it.op == sch.FINAL:
                    assert sch.RsItem(sch.NODE_SUM, pe, it.unit) in b[:i]
        by_op = collections.defaultdict(list)
        for it in items:
            by_op[it.op].append(it)
            r = units.rect(it.seg, it.unit)
            assert it.seg * ms <= r.lo < r.hi <= (it.seg + 1) * ms and r.lo // tm == (r.hi - 1) // tm
            assert 0 <= r.c0 < r.c1 <= n
            assert it.unit < sch.rs_max_units(ms, ur, units.groups)
        assert len(by_op[sch.FINAL]) == (units.count(pe) if nodes > 1 else 0)
        for it in by_op[sch.NODE_SUM]:
            assert it.seg % L == pe % L  # the segments with my local index, on every node
            summed[(it.seg, it.unit)] += 1
        assert not by_op[sch.COPY]
    assert summed == {(s, u): nodes for s in range(world) for u in range(units.count(s))}


@pytest.mark.parametrize("ms,ur,tm,n,tn,gt", [(100, 8, 128, 1000, 256, 2), (256, 8, 128, 2048, 256, 4),
                                              (7, 4, 128, 64, None, None), (256, 16, 128, 768, 128, 4),
                                              (300, 64, 128, 4096, 256, 3)])
def test_rs_units_tile_every_segment_once(ms, ur, tm, n, tn, gt):
    """A segment's units cover its [ms, n] block exactly once, each inside one M-tile and within its column group's
    N-tiles; their packed node-partial slots tile the same block exactly once too."""
    units = sch.rs_units(ms, ur, tm, n, tn, gt)
    tile_n = tn or n
    for seg in (0, 1, 3):
        cells = collections.Counter()
        slots = collections.Counter()
        for u in range(units.count(seg)):
            r = units.rect(seg, u)
            mt, g = units.piece(seg, u)
            assert r.lo // tm == (r.hi - 1) // tm == mt
            assert r.c0 == g * units.group_tiles * tile_n and r.c1 <= min(n, r.c0 + units.group_tiles * tile_n)
            cells.update((row, col) for row in range(r.lo, r.hi) for col in range(r.c0, r.c1, 8))
            slots.update(range(r.slot, r.slot + (r.hi - r.lo) * (r.c1 - r.c0), 8))
        assert cells == {(row, col): 1 for row in range(seg * ms, (seg + 1) * ms) for col in range(0, n, 8)}
        assert slots == {i: 1 for i in range(0, ms * n, 8)}
    with pytest.raises(ValueError, match="group_tiles"):
        sch.rs_units(ms, ur, tm, n, tn, 10 ** 6)
    with pytest.raises(ValueError, match="unit_rows"):
        sch.rs_units(ms, 3, 8, n)


@pytest.mark.parametrize("tiles_m,tiles_n,cm,sw,gt", [(64, 32, 2, 1, 32), (64, 32, 2, 4, 16), (13, 5, 2, 2, 2),
                                                      (8, 3, 1, 8, 1), (6, 4, 2, 8, 4)])
def test_rs_completion_follows_the_scheduler(tiles_m, tiles_n, cm, sw, gt):
    """Pieces complete in the order of the last scheduler item that writes them, every piece once; with swizzle 1
    and whole rows that is the M-tile order itself (the order before column groups existed)."""
    order = list(range(tiles_m))[::-1]
    comp = sch.rs_completion(order, tiles_n, cm, sw, gt)
    groups = -(-tiles_n // gt)
    assert sorted(comp) == sorted((t, g) for t in range(tiles_m) for g in range(groups))
    items = sch.gemm_items(tiles_m, tiles_n, cm, sw)
    assert sorted(items) == sorted((r, nt) for r in range(-(-tiles_m // cm)) for nt in range(tiles_n))
    last = {}
    for w, (row, nt) in enumerate(items):
        for i in range(row * cm, min(tiles_m, (row + 1) * cm)):
            last[(order[i], nt // gt)] = w
    assert sch.rs_piece_items(order, tiles_n, cm, sw, gt) == last
    assert [last[p] for p in comp] == sorted(last[p] for p in comp)
    if sw == 1 and gt == tiles_n:
        assert [t for t, _ in comp] == order


def test_rs_items_follow_completion():
    """NODE_SUMs are issued in the order the GEMM completes their pieces: with a 4-row swizzle and half-row groups
    at W = 8 (one node), the first half of every segment's first M-tile comes before any second half."""
    world, m, tm, n, tn = 8, 8192, 128, 8192, 256
    units = sch.rs_units(m // world, 8, tm, n, tn, 16)
    order = sch.rs_tile_order(0, world, world, m, tm)
    comp = sch.rs_completion(order, n // tn, 2, 4, 16)
    assert comp[:8] == [(t, 0) for t in order[:8]] and comp[8:16] == [(t, 1) for t in order[:8]]
    rank = {p: i for i, p in enumerate(comp)}
    items = [it for it, _ in sch.rs_items(3, world, world, m, units, completion=comp)]
    ranks = [rank[units.piece(it.seg, it.unit)] for it in items]
    assert ranks == sorted(ranks) and {it.seg for it in items} == {3}


def test_rs_plan_standalone_copies_first():
    units = sch.rs_units(32, 8, 8, 64)
    plan = sch.rs_plan(0, 2, 2, 64, units, blocks=2, copy_rows=64)
    items = [it for b in plan for it in b]
    copies = [it for it in items if it.op == sch.COPY]
    assert sorted(it.unit for it in copies) == list(range(8))
    for b in plan:
        ops = [it.op for it in b]
        assert ops[:ops.count(sch.COPY)] == [sch.COPY] * ops.count(sch.COPY)
    with pytest.raises(ValueError, match="segments"):
        sch.rs_items(0, 2, 2, 48, units)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on PATH")
    exe = tmp_path_factory.mktemp("sched") / "schedule_dump"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'include'}", str(ROOT / "tests/cpp/schedule_dump.cpp"),
                    "-o", str(exe)], check=True)

    def run(*args) -> list[list[int]]:
        out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout
        return [list(map(int, line.split())) for line in out.splitlines()]
    return run


@pytest.mark.parametrize("ms,ur", [(128, 128), (100, 32), (1000, 64), (7, 4), (256, 1)])
def test_cpp_unit_rows_match_python(dump, ms, ur):
    for seg in (0, 1, 5):
        units = sch.rs_row_units(ms, ur, seg)
        got = dump("rs_rows", ms, ur, seg, units)
        assert got == [[u, *sch.rs_unit_rows(ms, ur, seg, u)] for u in range(units)]


@pytest.mark.parametrize("ms,ur,n,tn,gt", [(100, 8, 1000, 256, 2), (1024, 8, 8192, 256, 16), (7, 4, 64, 64, 1),
                                           (300, 64, 4096, 128, 5)])
def test_cpp_units_match_python(dump, ms, ur, n, tn, gt):
    units = sch.rs_units(ms, ur, 128, n, tn, gt)
    for seg in (0, 2):
        got = dump("rs_unit", ms, ur, n, tn, gt, seg, units.count(seg))
        assert got == [[u, *units.rect(seg, u)] for u in range(units.count(seg))]


def test_cpp_chunks(dump):
    got = dump("chunks", 1000, 300, 5)
    assert got == [[0, 0, 300], [1, 300, 300], [2, 600, 300], [3, 900, 100], [4, 1200, 0]]


@pytest.mark.parametrize("world,L", [(2, 2), (4, 4), (8, 4), (4, 1)])
@pytest.mark.parametrize("sw,gt", [(1, None), (2, 2)])
def test_rs_tail_split(world, L, sw, gt):
    """The last pieces' items move to the tail plan (launched after the GEMM), nothing lost or duplicated, NODE_SUMs
    before FINALs in every tail block."""
    ms, ur, tm, n, tn = 512, 16, 128, 1024, 256
    m = ms * world
    units = sch.rs_units(ms, ur, tm, n, tn, gt)
    for pe in range(world):
        comp = sch.rs_completion(sch.rs_tile_order(pe, world, L, m, tm), units.tiles_n, 2, sw, units.group_tiles)
        plan = sch.rs_plan(pe, world, L, m, units, blocks=3, completion=comp)
        main, tail = sch.rs_split_tail(plan, comp, 3, units, tail_blocks=5)
        everything = sorted(it for b in plan for it in b)
        assert sorted(it for b in main + tail for it in b) == everything
        last = set(comp[-3:])
        assert all(units.piece(it.seg, it.unit) in last for b in tail for it in b)
        assert all(units.piece(it.seg, it.unit) not in last for b in main for it in b)
        for b in tail:
            ops = [it.op for it in b]
            assert ops == sorted(ops)
        assert sch.rs_split_tail(plan, comp, 0, units, 5) == (plan, [])


def test_plan_tensors_pad_to_cluster_multiple():
    """A comm kernel launched in clusters beside the GEMM: idle blocks fill its last cluster, empty blocks of the
    plan are dropped first."""
    per = sch.ag_plan(1, 4, 4, 2, 5) + [[]]  # 8 units on 5 blocks, and a block without work
    units, offsets, grid = sch.plan_tensors(per, "cpu")
    assert grid == 5 and offsets.tolist() == [0, 2, 4, 6, 7, 8]
    units, offsets, grid = sch.plan_tensors(per, "cpu", multiple=2)
    assert grid == 6 and offsets.tolist() == [0, 2, 4, 6, 7, 8, 8]  # block 5 does nothing
    assert sch.plan_tensors(per, "cpu", multiple=1)[2] == 5
    from flux_shmem.plan.search import gemm_sms_for
    assert gemm_sms_for(64, 2, 4) == 60 and gemm_sms_for(64, 2, 1) == 62 and gemm_sms_for(63, 2, 1) == 60
