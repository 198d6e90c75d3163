"""Tests for flux_shmem.launch (CPU only: fake mpirun/nvidia-smi + one real mpirun run)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

try:
    from flux_shmem import launch
except ImportError:  # package not importable (no __init__ yet / not on sys.path)
    _spec = importlib.util.spec_from_file_location(
        "flux_shmem_launch", REPO / "flux_shmem" / "launch.py")
    launch = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(launch)

NVLS = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def fakebin(tmp_path: Path) -> Path:
    """A PATH dir with a fake Open MPI 4 mpirun and no nvidia-smi."""
    d = tmp_path / "bin"
    d.mkdir()
    _exe(d / "mpirun", 'echo "mpirun (Open MPI) 4.1.6"')
    return d


def build(argv: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    return launch.build_command(launch.parse_args(argv), environ)


def xvars(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]


def opt(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def sub_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}  # the launcher must add them
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_launcher(args: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flux_shmem.launch", *args], cwd=REPO,
                          env=sub_env(**env), capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------- #
# argument splitting
# --------------------------------------------------------------------------- #
def test_program_options_are_not_launcher_options():
    a = launch.parse_args(["-n", "2", "benchmarks/run.py", "--quick", "-n", "9"])
    assert a.np == 2 and a.program == ["benchmarks/run.py", "--quick", "-n", "9"]
    a = launch.parse_args(["--np=3", "--", "--weird-prog", "x"])
    assert a.np == 3 and a.program == ["--weird-prog", "x"]
    a = launch.parse_args(["-n", "2", "-m", "pkg.mod", "--flag"])
    assert a.program == ["-m", "pkg.mod", "--flag"]
    a = launch.parse_args(["--mpi-arg", "--mca btl ^openib", "--mpi-arg=--tag-output", "p"])
    assert a.mpi_arg == ["--mca btl ^openib", "--tag-output"] and a.program == ["p"]


def test_python_programs_use_current_interpreter(fakebin):
    env = {"PATH": str(fakebin)}
    cmd, _ = build(["-n", "2", "benchmarks/run.py", "--quick"], env)
    assert cmd[-3:] == [sys.executable, "benchmarks/run.py", "--quick"]
    cmd, _ = build(["-n", "2", "-m", "pkg.mod", "-v"], env)
    assert cmd[-4:] == [sys.executable, "-m", "pkg.mod", "-v"]
    cmd, _ = build(["-n", "2", "--", "hostname"], env)
    assert cmd[-1] == "hostname" and sys.executable not in cmd


# --------------------------------------------------------------------------- #
# command lines
# --------------------------------------------------------------------------- #
def test_single_host_no_gpu_defaults_to_one_process(fakebin):
    cmd, _ = build(["--", "prog"], {"PATH": str(fakebin)})  # no nvidia-smi on PATH
    assert cmd[0] == "mpirun" and opt(cmd, "-np") == "1"
    assert "--oversubscribe" in cmd and opt(cmd, "--bind-to") == "none"
    assert "--host" not in cmd and "--hostfile" not in cmd and "--map-by" not in cmd


def test_single_host_gpu_count_from_nvidia_smi(fakebin):
    lines = "\\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})" for i in range(4))
    _exe(fakebin / "nvidia-smi", f'printf "{lines}\\n  MIG 1g.18gb Device 0: (UUID: x)\\n"')
    cmd, _ = build(["--", "prog"], {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "4"
    cmd, _ = build(["--", "prog"], {"PATH": str(fakebin), "CUDA_VISIBLE_DEVICES": "1,3"})
    assert opt(cmd, "-np") == "2"
    # More PEs than GPUs is allowed (PEs share GPUs).
    cmd, _ = build(["-n", "8", "--", "prog"], {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "8" and "--oversubscribe" in cmd


def test_hosts_with_slots(fakebin, capsys):
    cmd, _ = build(["--hosts", "a:8,b:8", "--", "prog"], {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "16" and opt(cmd, "--host") == "a:8,b:8"
    assert opt(cmd, "--map-by") == "ppr:8:node" and "--oversubscribe" not in cmd
    assert opt(cmd, "--bind-to") == "none"
    # more ranks than slots -> oversubscribe with a warning
    cmd, _ = build(["--hosts", "a:8,b:8", "-n", "32", "--", "prog"], {"PATH": str(fakebin)})
    assert "--oversubscribe" in cmd and opt(cmd, "--map-by") == "ppr:16:node"
    assert "exceeds the 16 slots" in capsys.readouterr().err


def test_hosts_without_slots_get_slots_filled(fakebin):
    cmd, _ = build(["--hosts", "a,b", "--gpus-per-node", "4", "--", "prog"],
                   {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "8" and opt(cmd, "--host") == "a:4,b:4"
    assert opt(cmd, "--map-by") == "ppr:4:node"


def test_uneven_explicit_np_warns(fakebin, capsys):
    cmd, _ = build(["--hosts", "a:8,b:8", "-n", "3", "--", "prog"], {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "3" and "--map-by" not in cmd
    assert "uneven" in capsys.readouterr().err


def test_hostfile_regular_with_slots_passed_as_is(fakebin, tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# comment\nnode1 slots=8\nnode2 slots=8  # trailing\n\n")
    cmd, _ = build(["--hostfile", str(hf), "--", "prog"], {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "16" and opt(cmd, "--hostfile") == str(hf)
    assert opt(cmd, "--map-by") == "ppr:8:node"


def test_hostfile_without_slots_is_normalized(fakebin, tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node1\nnode2\n")
    try:
        cmd, _ = build(["--hostfile", str(hf), "--gpus-per-node", "8", "--", "prog"],
                       {"PATH": str(fakebin)})
        path = opt(cmd, "--hostfile")
        assert path != str(hf) and path in launch._TEMP_FILES
        assert Path(path).read_text() == "node1 slots=8\nnode2 slots=8\n"
        assert opt(cmd, "-np") == "16"
    finally:
        launch._cleanup_temp_files()


def test_nodes_without_hosts_uses_allocation(fakebin):
    cmd, _ = build(["--nodes", "2", "--gpus-per-node", "8", "--", "prog"],
                   {"PATH": str(fakebin)})
    assert opt(cmd, "-np") == "16" and opt(cmd, "--map-by") == "ppr:8:node"
    assert "--oversubscribe" not in cmd


def test_mpich_hydra_flavor(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    _exe(d / "mpirun", 'echo "HYDRA build details:"; echo "    Version: 4.1"')
    cmd, env = build(["--hosts", "a:4,b:4", "--", "prog"], {"PATH": str(d)})
    assert opt(cmd, "-n") == "8" and opt(cmd, "-hosts") == "a:4,b:4"
    assert opt(cmd, "-ppn") == "4" and "-genvall" in cmd and "-x" not in cmd
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_mpi_args_passed_through(fakebin):
    cmd, _ = build(["--mpi-arg", "--mca btl ^openib", "--mpi-arg", "--tag-output",
                    "--", "prog"], {"PATH": str(fakebin)})
    i = cmd.index("--mca")
    assert cmd[i:i + 4] == ["--mca", "btl", "^openib", "--tag-output"]
    assert cmd[-1] == "prog"


# --------------------------------------------------------------------------- #
# environment
# --------------------------------------------------------------------------- #
def test_env_defaults_user_env_and_flags(fakebin):
    environ = {"PATH": str(fakebin), "NVSHMEM_DEBUG": "INFO", "MYVAR": "x", "OTHER": "y"}
    cmd, env = build(["--env", "FOO=bar=baz", "--env", "PYTHONUNBUFFERED=0",
                      "--pass-env", "MYVAR", "--hca", "mlx5_0,mlx5_1",
                      "--bootstrap-ifname", "eth0", "--force-put", "--timeout-s", "30",
                      "--", "prog"], environ)
    for k, v in NVLS.items():
        assert env[k] == v
    assert env["FOO"] == "bar=baz" and env["PYTHONUNBUFFERED"] == "0"
    assert env["NVSHMEM_HCA_LIST"] == env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "eth0"
    assert env["FLUX_SHMEM_FORCE_PUT"] == "1" and env["FLUX_SHMEM_TIMEOUT_S"] == "30"
    xs = xvars(cmd)
    expected = {*NVLS, "FOO", "PYTHONUNBUFFERED", "MYVAR", "NVSHMEM_HCA_LIST", "NCCL_IB_HCA",
                "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "FLUX_SHMEM_FORCE_PUT",
                "FLUX_SHMEM_TIMEOUT_S", "NVSHMEM_DEBUG", "PATH"}
    assert expected <= set(xs) and "OTHER" not in xs and len(xs) == len(set(xs))
    # -x options come before the program
    assert cmd.index("prog") > max(i for i, a in enumerate(cmd) if a == "-x")


def test_nvls_always_forced_with_warning(fakebin, capsys):
    environ = {"PATH": str(fakebin), "NCCL_NVLS_ENABLE": "1"}
    _, env = build(["--env", "NVSHMEM_DISABLE_NVLS=0",
                    "--env", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "--", "prog"], environ)
    assert all(env[k] == v for k, v in NVLS.items())
    err = capsys.readouterr().err
    assert "NVSHMEM_DISABLE_NVLS=0 ignored" in err and "NCCL_NVLS_ENABLE=1 ignored" in err
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in err  # already the safe value


def test_root_env_only_when_root(fakebin, monkeypatch):
    monkeypatch.setattr(launch.os, "geteuid", lambda: 0)
    cmd, env = build(["--", "prog"], {"PATH": str(fakebin)})
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in xvars(cmd)  # read by mpirun only
    monkeypatch.setattr(launch.os, "geteuid", lambda: 1000)
    _, env = build(["--", "prog"], {"PATH": str(fakebin)})
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env


def test_pass_env_missing_warns(fakebin, capsys):
    cmd, _ = build(["--pass-env", "NOT_SET_ANYWHERE", "--", "prog"], {"PATH": str(fakebin)})
    assert "NOT_SET_ANYWHERE" not in xvars(cmd)
    assert "--pass-env NOT_SET_ANYWHERE" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# errors (exit code 2 + a message naming the fix)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("argv, needle", [
    ([], "no program given"),
    (["-n", "2"], "no program given"),
    (["-n", "0", "prog"], "-n/--np must be >= 1"),
    (["--hosts", "a", "--hostfile", "f", "prog"], "use only one"),
    (["--gpus-per-node", "0", "prog"], "--gpus-per-node must be >= 1"),
    (["--env", "NOEQUALS", "prog"], "--env expects K=V"),
    (["--timeout-s", "-1", "prog"], "--timeout-s must be > 0"),
])
def test_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--mpirun", "/nonexistent/mpirun", "prog"], "--mpirun /path/to/mpirun"),
    (["--hostfile", "/nonexistent/hosts", "prog"], "cannot read hostfile"),
    (["--hosts", "a:8,b:8", "-n", "13", "--gpus-per-node", "8", "prog"],
     "not divisible by 2 nodes"),
    (["--hosts", "a:x", "prog"], "bad slot count"),
    (["--hosts", "a,b", "--nodes", "3", "prog"], "drop --nodes"),
])
def test_launch_errors(argv, needle, fakebin, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(fakebin))
    assert launch.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_mpirun_not_on_path_subprocess(tmp_path):
    r = run_launcher(["-n", "2", "prog"], PATH=str(tmp_path))
    assert r.returncode == 2 and "mpirun not found" in r.stderr and not r.stdout


def test_no_program_subprocess():
    r = run_launcher(["-n", "2"])
    assert r.returncode == 2 and "no program given" in r.stderr


# --------------------------------------------------------------------------- #
# subprocess: --dry-run and a real mpirun run
# --------------------------------------------------------------------------- #
def test_dry_run_prints_one_line():
    r = run_launcher(["--dry-run", "--hosts", "a:8,b:8", "--env", "FOO=a b",
                      "--mpi-flavor", "openmpi", "bench.py", "--quick"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    toks = shlex.split(lines[0])
    mpirun_at = toks.index("mpirun")
    prefix, cmd = toks[:mpirun_at], toks[mpirun_at:]
    assert all("=" in t for t in prefix) and "FOO=a b" in prefix
    assert cmd[:3] == ["mpirun", "-np", "16"] and opt(cmd, "--host") == "a:8,b:8"
    assert {"FOO", *NVLS} <= set(xvars(cmd))
    assert cmd[-2:] == ["bench.py", "--quick"] and cmd[-3] == sys.executable


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_real_run_two_ranks():
    code = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print('rank', c.Get_rank(), 'of', c.Get_size(), "
            "'nvls', os.environ.get('NVSHMEM_DISABLE_NVLS'), "
            "'foo', os.environ.get('FOO'), flush=True)")
    r = run_launcher(["-n", "2", "--env", "FOO=bar", "--env", "NVSHMEM_DISABLE_NVLS=0",
                      "--", sys.executable, "-c", code], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 nvls 1 foo bar" in r.stdout, r.stdout + r.stderr
    assert "NVSHMEM_DISABLE_NVLS=0 ignored" in r.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_sigterm_is_forwarded_to_mpirun():
    code = "import time; print('ready', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-m", "flux_shmem.launch", "-n", "2", "--",
                          sys.executable, "-c", code], cwd=REPO, env=sub_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
        assert rc != 0 and time.monotonic() - t0 < 20
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
