"""GPU tests: tests/gpu/checks.py under mpirun with 1, 2 and 4 PEs (several PEs may share one GPU), plus timeouts,
and the nn checks under torchrun compared with flux-launch. Skipped with the reason where there is no Hopper GPU.

With FLUX_SHMEM_TEST_MPS=1 (a CUDA MPS daemon running: `bash benchmarks/gpu_session.sh mps tests`) each launch
gives its PEs CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / PEs, so they run at once: races and overlap show. Without
MPS, PEs sharing a GPU time-slice (correctness only) and the soak is shortened."""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "gpu" / "checks.py"
TORCHRUN_CHECK = ROOT / "tests" / "gpu" / "torchrun_check.py"
pytestmark = pytest.mark.gpu


MPS = os.environ.get("FLUX_SHMEM_TEST_MPS") == "1"


def _log(what: str, env, proc: subprocess.CompletedProcess) -> None:
    logdir = os.environ.get("FLUX_SHMEM_TEST_LOGDIR")  # full logs of each launch (device runs)
    if logdir:
        with open(Path(logdir, "launches.log"), "a") as f:
            f.write(f"===== {what} env={env} rc={proc.returncode}\n{proc.stdout}{proc.stderr}\n")


def mps_percentage(np_: int) -> str:
    """Each PE's MPS share: all of it when green contexts say which SMs are whose, else an equal split."""
    return "100" if os.environ.get("FLUX_SHMEM_SM_PARTITION", "none") == "green" else str(100 // np_)


def launch(np_: int, *groups: str, env: dict | None = None, timeout: int = 600,
           script: Path = CHECKS) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flux_shmem.launch", "-n", str(np_), "--", sys.executable, str(script), *groups]
    base = {**os.environ, "FLUX_SHMEM_TIMEOUT_S": os.environ.get("FLUX_SHMEM_TIMEOUT_S", "60")}
    if MPS:
        base["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = mps_percentage(np_)
    base.setdefault("FLUX_SHMEM_CHECK_PLANS", "1")  # every new plan's digest compared across PEs
    proc = subprocess.run(cmd, cwd=ROOT, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    _log(f"np={np_} {script.name} groups={groups}", env, proc)
    proc.groups = groups
    return proc


def torchrun(np_: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node np_ tests/gpu/torchrun_check.py args...`, without any MPI launcher variables."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))}
    env.update(NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               PYTHONUNBUFFERED="1")
    if MPS:  # the same SM share as launch() gives
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = mps_percentage(np_)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np_), "--master-addr",
           "127.0.0.1", "--master-port", str(port), str(TORCHRUN_CHECK), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    _log(f"torchrun np={np_} {args}", None, proc)
    return proc


@functools.lru_cache(maxsize=None)
def _checks_module():
    spec = importlib.util.spec_from_file_location("gpu_checks", CHECKS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expected_checks(groups) -> list[str]:
    """The names of the checks that `tests/gpu/checks.py GROUPS...` runs."""
    return [fn.__name__ for _, fn in _checks_module().plan_for(list(groups))]


def assert_checks_passed(proc: subprocess.CompletedProcess, expected: int | None = None) -> None:
    """Exit status 0, no failure, and every check of the launch's groups reported exactly once, `ok` or `skip`
    (with its reason); `expected`: for another script, the exact number of `CHECK <name> ok` lines."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "FAILED" not in out, out[-6000:]
    if expected is not None:
        assert len(re.findall(r"^CHECK \S+ ok\b", out, re.M)) == expected, out[-6000:]
        return
    names = expected_checks(proc.groups)
    assert names, proc.groups
    for name in names:
        seen = re.findall(rf"^CHECK {name} (ok\b|skip: .+)", out, re.M)
        assert len(seen) == 1, (name, seen, out[-6000:])


@pytest.mark.parametrize("np_", [1, 2])
def test_runtime_and_collectives(np_):
    assert_checks_passed(launch(np_, "runtime", "collectives"))


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_fused_gemms(np_):
    assert_checks_passed(launch(np_, "gemm"))


@pytest.mark.parametrize("np_", [2, 4])
def test_soak(np_):
    """2,000 back-to-back fused calls per op, inputs changing, checked every 100 (under MPS: PEs at once)."""
    calls = "2000" if MPS else "200"
    assert_checks_passed(launch(np_, "soak", env={"FLUX_SHMEM_SOAK_CALLS": calls}, timeout=900))


def test_hazards():
    """Input overwritten under a slow reader, reduce over a node of 4, SM budget and occupancy, link pacing."""
    assert_checks_passed(launch(2, "hazards", "emulation"))


def test_large_node():
    """A node of 12 PEs (more than the 8 the reduce kernel once had room for)."""
    assert_checks_passed(launch(12, "large_node_reduce", timeout=900))


def test_fused_gemms_forced_put():
    assert_checks_passed(launch(2, "gemm", env={"FLUX_SHMEM_FORCE_PUT": "1"}))


def test_forced_put_path():
    """Every peer through NVSHMEM put/signal: the inter-node code path, on one node."""
    assert_checks_passed(launch(2, "collectives", env={"FLUX_SHMEM_FORCE_PUT": "1"}))


def test_timeout_raises_with_details():
    proc = launch(1, "timeout_raise", env={"FLUX_SHMEM_ON_TIMEOUT": "raise", "FLUX_SHMEM_TIMEOUT_S": "2"})
    assert_checks_passed(proc)


def test_split_k_lock_times_out_with_details():
    proc = launch(1, "timeout_split_k", env={"FLUX_SHMEM_ON_TIMEOUT": "raise", "FLUX_SHMEM_TIMEOUT_S": "2"})
    assert_checks_passed(proc)


def test_timeout_traps_and_reports():
    proc = launch(1, "timeout_trap", env={"FLUX_SHMEM_TIMEOUT_S": "2"}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "PE 0 timed out after 2 s waiting on test signal 0: needed >= 7, saw 0" in out, out[-4000:]


@pytest.mark.parametrize("np_", [1, 2])
def test_fp8_fused_ops(np_):
    """Both fused ops with e4m3 operands against a dequantized fp64 reference (group fp8)."""
    assert_checks_passed(launch(np_, "fp8", timeout=900))


def test_fp8_fused_ops_forced_put():
    assert_checks_passed(launch(2, "fp8", env={"FLUX_SHMEM_FORCE_PUT": "1"}, timeout=900))


@pytest.mark.parametrize("backend", ["ours", "cublas"])
def test_fused_gemms_with_each_plain_backend(backend):
    """The decomposed and one-PE paths with each plain-GEMM backend (FLUX_SHMEM_PLAIN_GEMM), 1 and 2 PEs."""
    for np_ in (1, 2):
        assert_checks_passed(launch(np_, "gemm", env={"FLUX_SHMEM_PLAIN_GEMM": backend}))


def test_every_m_and_small_m():
    """Issue 25's sweep: 50 distinct M per op checked, graphs after prepare(), small-M auto (group sweep)."""
    assert_checks_passed(launch(2, "sweep", timeout=900))


@pytest.mark.parametrize("np_,env", [(1, {}), (2, {}), (2, {"FLUX_SHMEM_FORCE_PUT": "1"})])
def test_moe_ops(np_, env):
    """Issue 38: AllGatherGroupGEMM and GroupGEMMReduceScatter against fp64 torch (balanced, skewed and empty-expert
    routing, both layouts, a graph replay, bad ids raising on every PE; group moe)."""
    assert_checks_passed(launch(np_, "moe", env=env))


def test_two_level_path_on_one_host():
    """4 PEs as 2 'nodes' of 2: NVLink stores inside a node, puts and forwards between nodes, node partials."""
    assert_checks_passed(launch(4, "collectives", "gemm", env={"FLUX_SHMEM_NODE_SIZE": "2"}))


NN_CHECKS = len(expected_checks(["nn"]))  # tests/gpu/checks.py group "nn"


@pytest.mark.parametrize("np_", [1, 2])
def test_nn_layers_and_block(np_):
    """flux_shmem.nn: both layers, the Llama block, torch.compile(fullgraph=True), a CUDA-graph training step."""
    assert_checks_passed(launch(np_, "nn", timeout=900))


def test_nn_forced_put():
    assert_checks_passed(launch(2, "nn", env={"FLUX_SHMEM_FORCE_PUT": "1"}, timeout=900))


def test_torchrun_matches_flux_launch(tmp_path):
    """The nn checks bootstrapped by torchrun, and a fixed training step equal to flux-launch's, rank by rank."""
    fl = launch(2, "--launcher", "mpi", "--save", str(tmp_path / "fl"), script=TORCHRUN_CHECK, timeout=900)
    assert_checks_passed(fl, NN_CHECKS + 1)
    tr = torchrun(2, "--launcher", "torch", "--save", str(tmp_path / "tr"), "--compare", str(tmp_path / "fl"),
                  timeout=900)
    assert_checks_passed(tr, NN_CHECKS + 1)
    assert (tr.stdout + tr.stderr).count("tensors bitwise equal to") == 2, (tr.stdout + tr.stderr)[-6000:]
