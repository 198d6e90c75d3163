"""flux_shmem under torchrun on a machine without a GPU: the torch.distributed bootstrap and flux_shmem.nn's layers
on torch.distributed (gloo), eager and compiled, over a real `torchrun --nproc-per-node 2`."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_bootstrap_and_layers(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test checks the no-GPU path; tests/test_gpu.py covers GPU machines")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(PYTHONPATH=str(ROOT), NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "tests/dist/torchrun_probe.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(reports):
        assert r["launcher"] == "torch" and "gloo" in r["backend"]
        assert r["layout"] == [rank, 2, rank, 2, 0, 1]
        assert r["uid_equal"] and r["bytes"] == "from 1"
        assert "PE 0: (4, 4)" in r["mismatch"] and "PE 1: (4, 5)" in r["mismatch"]
        assert "no CUDA device visible on rank(s) [0, 1]" in r["init"]
        assert r["block_backend"] == "torch"
        for run in ("eager", "compiled"):
            assert len(r[run]) == 10 and max(r[run].values()) < 1e-10, (run, r[run])
    assert "not every PE joined the collective call lonely" in reports[0]["timeout"]
