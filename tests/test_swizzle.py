"""The GEMM scheduler swizzle policy (flux_shmem/kernels/gemm.py swizzle_for)."""
import pytest


def test_swizzle_policy(monkeypatch):
    """Groups of swizzle * cluster_m M-tiles: 8 clusters when the problem allows, never a group larger than the
    limit (fused ops: one shard), always a supported value; the environment override is checked."""
    from flux_shmem.errors import FluxShmemError
    from flux_shmem.kernels.gemm import SWIZZLES, swizzle_for

    monkeypatch.delenv("FLUX_SHMEM_GEMM_SWIZZLE", raising=False)
    assert swizzle_for(128, 2) == 8
    assert swizzle_for(8, 2) == 4 and swizzle_for(3, 2) == 1 and swizzle_for(1, 2) == 1
    assert swizzle_for(128, 2, group_m_tiles=8) == 4 and swizzle_for(128, 2, group_m_tiles=1) == 1
    assert swizzle_for(128, 1, group_m_tiles=5) == 4
    for tm in range(1, 70):
        for g in (None, 1, 2, 3, 8, 16, 100):
            s = swizzle_for(tm, 2, g)
            assert s in SWIZZLES
            assert s == 1 or s * 2 <= min(tm, g or tm)
    monkeypatch.setenv("FLUX_SHMEM_GEMM_SWIZZLE", "2")
    assert swizzle_for(128, 2) == 2
    monkeypatch.setenv("FLUX_SHMEM_GEMM_SWIZZLE", "3")
    with pytest.raises(FluxShmemError, match="FLUX_SHMEM_GEMM_SWIZZLE"):
        swizzle_for(128, 2)
