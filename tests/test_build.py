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
    for name in (b"fs_all_gather", b"fs_reduce_scatter_bf16", b"fs_barrier", b"fs_epoch_bump", b"fs_wait_flags", b"fs_signal_done", b"nvshmemi_device_state_d"):
        assert name in data, name
    assert kb.cached("collectives", "90a") == art  # second lookup is a cache hit


def test_cache_key_tracks_versions_and_arch(monkeypatch):
    k1 = kb.cache_key("collectives", "90a")
    assert "nvshmem" in k1 and "sm90a" in k1
    # collectives include no CUTLASS: their key does not name it, so they load where CUTLASS is not installed
    assert "cutlass" not in k1 and "cutlass" in kb.cache_key("gemm_rs", "90a")
    assert kb.cache_key("collectives", "90") != k1
    tc = kb.toolchain()
    monkeypatch.setattr(kb, "toolchain", lambda: kb.Toolchain(tc.nvshmem_root, "0.0.0", tc.cutlass_includes,
                                                               tc.cutlass_version))
    assert kb.cache_key("collectives", "90a") != k1
    monkeypatch.setattr(kb, "toolchain", lambda: kb.Toolchain(tc.nvshmem_root, tc.nvshmem_version,
                                                               tc.cutlass_includes, "0.0"))
    assert kb.cache_key("collectives", "90a") == k1


def test_gemm_configs_are_keyed_and_flagged():
    """GEMM families are built per registry configuration: its FS_GEMM_* macros are -D flags and in the key."""
    from flux_shmem.kernels import registry
    k0 = kb.cache_key("gemm_rs", "90a")
    for name in registry.names():
        cfg = registry.get(name)
        assert all(f"-D{d}" in kb._flags(cfg) for d in cfg.defines)
        assert (kb.cache_key("gemm_rs", "90a", name) == k0) == (name == registry.DEFAULT)
    assert kb._flags(None) == kb._CXX_FLAGS


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


def test_sources_are_the_headers_a_family_includes():
    """A family's key covers its source and the project headers it includes, transitively, and no others."""
    names = lambda fam: {p.name for p in kb._sources(fam)}  # noqa: E731
    gemm, comm = names("gemm_rs"), names("collectives")
    assert {"gemm_rs.cu", "gemm_ext.cuh", "gemm_scheduler.cuh", "gemm_mainloop.cuh", "gemm_epilogue.cuh",
            "gemm_config.cuh", "gemm_host.cuh", "signal.cuh", "tile_schedule.cuh", "gemm_abi.h"} <= gemm
    assert "put.cuh" not in gemm and "pace.cuh" not in gemm  # comm-only headers do not rebuild the GEMMs
    assert {"collectives.cu", "put.cuh", "pace.cuh", "signal.cuh", "comm_schedule.cuh"} <= comm
    assert "gemm_ext.cuh" not in comm
