"""GPU tests: tests/gpu/checks.py under mpirun with 1, 2 and 4 PEs (several PEs may share one GPU), plus timeouts.
Skipped with the reason where there is no Hopper GPU.

With FLUX_SHMEM_TEST_MPS=1 (a CUDA MPS daemon running: `bash benchmarks/gpu_session.sh mps tests`) each launch
gives its PEs CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / PEs, so they run at once: races and overlap show. Without
MPS, PEs sharing a GPU time-slice (correctness only) and the soak is shortened."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "gpu" / "checks.py"
pytestmark = pytest.mark.gpu


MPS = os.environ.get("FLUX_SHMEM_TEST_MPS") == "1"


def launch(np_: int, *groups: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flux_shmem.launch", "-n", str(np_), "--", sys.executable, str(CHECKS), *groups]
    base = {**os.environ, "FLUX_SHMEM_TIMEOUT_S": os.environ.get("FLUX_SHMEM_TIMEOUT_S", "60")}
    if MPS:
        base["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // np_)
    proc = subprocess.run(cmd, cwd=ROOT, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    logdir = os.environ.get("FLUX_SHMEM_TEST_LOGDIR")  # full logs of each launch (device runs)
    if logdir:
        with open(Path(logdir, "launches.log"), "a") as f:
            f.write(f"===== np={np_} groups={groups} env={env} rc={proc.returncode}\n{proc.stdout}{proc.stderr}\n")
    return proc


def assert_checks_passed(proc: subprocess.CompletedProcess, groups_expected: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "FAILED" not in out, out[-6000:]
    assert out.count("CHECK ") >= groups_expected, out[-6000:]


@pytest.mark.parametrize("np_", [1, 2])
def test_runtime_and_collectives(np_):
    assert_checks_passed(launch(np_, "runtime", "collectives"), 10)


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_fused_gemms(np_):
    assert_checks_passed(launch(np_, "gemm"), 6)


@pytest.mark.parametrize("np_", [2, 4])
def test_soak(np_):
    """2,000 back-to-back fused calls per op, inputs changing, checked every 100 (under MPS: PEs at once)."""
    calls = "2000" if MPS else "200"
    assert_checks_passed(launch(np_, "soak", env={"FLUX_SHMEM_SOAK_CALLS": calls}, timeout=900), 1)


def test_hazards():
    """Input overwritten under a slow reader, reduce over a node of 4, SM budget and occupancy, link pacing."""
    assert_checks_passed(launch(2, "hazards", "emulation"), 4)


def test_large_node():
    """A node of 12 PEs (more than the 8 the reduce kernel once had room for)."""
    assert_checks_passed(launch(12, "large_node_reduce", timeout=900), 1)


def test_fused_gemms_forced_put():
    assert_checks_passed(launch(2, "gemm", env={"FLUX_SHMEM_FORCE_PUT": "1"}), 6)


def test_forced_put_path():
    """Every peer through NVSHMEM put/signal: the inter-node code path, on one node."""
    assert_checks_passed(launch(2, "collectives", env={"FLUX_SHMEM_FORCE_PUT": "1"}), 4)


def test_timeout_raises_with_details():
    proc = launch(1, "timeout_raise", env={"FLUX_SHMEM_ON_TIMEOUT": "raise", "FLUX_SHMEM_TIMEOUT_S": "2"})
    assert_checks_passed(proc, 1)


def test_timeout_traps_and_reports():
    proc = launch(1, "timeout_trap", env={"FLUX_SHMEM_TIMEOUT_S": "2"}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "PE 0 timed out after 2 s waiting on test signal 0: needed >= 7, saw 0" in out, out[-4000:]


def test_two_level_path_on_one_host():
    """4 PEs as 2 'nodes' of 2: NVLink stores inside a node, puts and forwards between nodes, node partials."""
    assert_checks_passed(launch(4, "collectives", "gemm", env={"FLUX_SHMEM_NODE_SIZE": "2"}), 10)
