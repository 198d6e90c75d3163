"""Tile orders of the fused GEMMs: every tile once, local data first for AG+GEMM, remote first for GEMM+RS."""
import pytest

from flux_shmem.ops._schedule import ag_segment_order, m_tile_order, rs_segment_order

TOPOS = [(1, 1), (2, 2), (2, 1), (4, 2), (8, 8), (16, 8), (8, 1)]


@pytest.mark.parametrize("world,L", TOPOS)
def test_segment_orders_are_permutations(world, L):
    for me in range(world):
        ag, rs = ag_segment_order(me, world, L), rs_segment_order(me, world, L)
        assert sorted(ag) == sorted(rs) == list(range(world))
        assert ag[0] == me and rs[-1] == me
        n = me // L
        # AG: my node's segments before any other node's; RS: the other nodes' before mine
        assert all(s // L == n for s in ag[:L]) and all(s // L != n for s in rs[: world - L])
    # different PEs start with different remote targets (spread), when there is a choice
    if world > 1:
        firsts = {rs_segment_order(me, world, L)[0] for me in range(world)}
        assert len(firsts) == world


@pytest.mark.parametrize("m,ms,tm", [(1024, 256, 128), (1000, 250, 128), (300, 100, 128), (128, 128, 128),
                                     (8192, 1024, 128), (100, 25, 128)])
@pytest.mark.parametrize("world,L", TOPOS)
def test_tile_order_covers_every_tile_once(m, ms, tm, world, L):
    if m != ms * world:
        m = ms * world
    for me in range(world):
        for seg_order in (ag_segment_order(me, world, L), rs_segment_order(me, world, L)):
            order = m_tile_order(seg_order, m, ms, tm)
            assert sorted(order) == list(range(-(-m // tm)))
            # segment positions never decrease along the order
            pos = {s: i for i, s in enumerate(seg_order)}
            keys = [max(pos[s] for s in range(t * tm // ms, (min(m, (t + 1) * tm) - 1) // ms + 1)) for t in order]
            assert keys == sorted(keys)


def test_local_tiles_first():
    order = m_tile_order(ag_segment_order(2, 4, 4), 1024, 256, 128)
    assert order[:2] == [4, 5]  # PE 2's rows 512..767 come first
    assert m_tile_order(rs_segment_order(2, 4, 4), 1024, 256, 128)[-2:] == [4, 5]
    with pytest.raises(ValueError):
        m_tile_order([0], 0, 1, 128)


def test_swizzle_policy(monkeypatch):
    """Groups of swizzle clusters of M-tiles: 8 clusters when the problem allows, never a group larger than the
    limit (fused ops: one shard or chunk) unless one cluster is, always a supported value; the override is checked."""
    from flux_shmem.errors import FluxShmemError
    from flux_shmem.kernels import registry
    from flux_shmem.kernels.config import ENV_FORCE, SWIZZLES, swizzle_for

    monkeypatch.delenv(ENV_FORCE, raising=False)
    cfg = registry.get("128x256_c2x1")  # 2-CTA clusters of 128-row tiles
    assert swizzle_for(cfg, 128 * 128)[0] == 8
    assert swizzle_for(cfg, 8 * 128)[0] == 4 and swizzle_for(cfg, 3 * 128)[0] == 2 and swizzle_for(cfg, 128)[0] == 1
    assert swizzle_for(cfg, 128 * 128, 8 * 128)[0] == 4 and swizzle_for(cfg, 128 * 128, 128)[0] == 1
    for tm in range(1, 70):
        for g in (None, 1, 2, 3, 8, 16, 100):
            s, _ = swizzle_for(cfg, tm * 128, g * 128 if g else None)
            assert s in SWIZZLES
            assert s == 1 or (s <= -(-tm // 2) and (g is None or s * 2 <= g))
    monkeypatch.setenv(ENV_FORCE, "swizzle=2")
    from flux_shmem.kernels.gemm import GemmHost
    host = GemmHost.__new__(GemmHost)  # swizzle() needs only the configuration and tile shape
    host.config, host.tile_shape = cfg, (128, 256)
    assert host.swizzle(128 * 128) == 2
    monkeypatch.setenv(ENV_FORCE, "swizzle=3")
    with pytest.raises(FluxShmemError, match=ENV_FORCE):
        host.swizzle(128 * 128)


@pytest.mark.parametrize("world,rows,chunk_rows", [(1, 64, 64), (2, 100, 40), (4, 256, 64), (8, 7, 3), (3, 5, 8)])
def test_copy_engine_all_gather_plan(world, rows, chunk_rows):
    """Simulate every PE's copy list on byte buffers: each PE's gather buffer ends up as the concatenation of the
    shards, every (shard, chunk) flag is raised exactly once on every PE, and only after its chunk's bytes; each
    PE fills its own buffer before any peer's."""
    from flux_shmem.ops._schedule import ag_ce_copies

    row_bytes = 6
    chunks = -(-rows // chunk_rows)
    shards = [bytes((17 * s + i) % 251 for i in range(rows * row_bytes)) for s in range(world)]
    gather = [bytearray(world * rows * row_bytes) for _ in range(world)]
    written = [[0] * (world * rows * row_bytes) for _ in range(world)]
    raised = [[0] * (world * chunks) for _ in range(world)]
    for me in range(world):
        plan = ag_ce_copies(me, world, rows, chunk_rows, row_bytes)
        assert len(plan) == world * chunks
        assert [cp.dest for cp in plan[:chunks]] == [me] * chunks  # own buffer first
        for cp in plan:
            src = shards[me][cp.src_offset:cp.src_offset + cp.nbytes]
            gather[cp.dest][cp.offset:cp.offset + cp.nbytes] = src
            for i in range(cp.offset, cp.offset + cp.nbytes):
                written[cp.dest][i] += 1
            # the flag of (me, chunk) goes up after its bytes: every byte of the chunk's rows is in place
            r0 = cp.chunk * chunk_rows
            lo, hi = (me * rows + r0) * row_bytes, (me * rows + min(rows, r0 + chunk_rows)) * row_bytes
            assert all(written[cp.dest][i] == 1 for i in range(lo, hi))
            assert cp.flag == me * chunks + cp.chunk
            raised[cp.dest][cp.flag] += 1
    for pe in range(world):
        assert bytes(gather[pe]) == b"".join(shards)
        assert all(w == 1 for w in written[pe]) and all(f == 1 for f in raised[pe])
    with pytest.raises(ValueError, match="geometry"):
        ag_ce_copies(0, 2, 0, 8, 16)
