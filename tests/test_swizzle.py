"""The GEMM scheduler swizzle policy (flux_shmem/kernels/config.py swizzle_for)."""
import pytest


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
