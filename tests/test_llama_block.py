"""benchmarks/llama_block.py on the CPU: the Llama-3-70B shapes, sharding of fused QKV / gate-up, the heap estimate,
the command line, the table, the no-GPU exit, and `benchmarks/run.py --ops block` delegating to it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import llama_block as lb
from benchmarks import run

ROOT = Path(__file__).resolve().parents[1]


def test_llama3_70b_shapes():
    c = lb.LLAMA3_70B
    assert (c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn) == (8192, 64, 8, 128, 28672)
    assert c.qkv_out == 10240
    for w in (1, 2, 4, 8):
        c.check_world(w)
    with pytest.raises(ValueError, match="kv_heads = 8 does not split over 16"):
        c.check_world(16)


def test_shard_full_splits_fused_projections_per_component():
    cfg = lb.BlockConfig(hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=6, bias=True)
    torch.manual_seed(0)
    ref = lb.ReferenceBlock(cfg, dtype=torch.float64)
    full = {n: p.detach() for n, p in ref.named_parameters()}
    parts = [lb.shard_full(cfg, full, r, 2) for r in range(2)]
    q, k, v = full["qkv.weight"].split([8, 4, 4])
    assert torch.equal(parts[1]["qkv.weight"], torch.cat([q[4:], k[2:], v[2:]]))
    gate, up = full["gate_up.weight"].chunk(2)
    assert torch.equal(parts[0]["gate_up.weight"], torch.cat([gate[:3], up[:3]]))
    assert torch.equal(parts[1]["down.weight"], full["down.weight"][:, 3:])
    assert torch.equal(parts[0]["o_proj.bias"], full["o_proj.bias"])  # row-parallel biases: whole
    tp = lb.TPBlock(cfg, backend=__import__("flux_shmem.nn", fromlist=["x"]).TorchBackend(), dtype=torch.float64)
    assert {n: tuple(p.shape) for n, p in tp.named_parameters()} == \
        {n: tuple(t.shape) for n, t in lb.shard_full(cfg, full, 0, 1).items()}


def test_attention_stand_in_and_sdpa_keep_shapes():
    q, k, v = torch.randn(6, 2, 4 * 3), torch.randn(6, 2, 2 * 3), torch.randn(6, 2, 2 * 3)
    for kind in ("elementwise", "sdpa"):
        assert lb.attention(q, k, v, 4, 2, 3, kind).shape == (6, 2, 12)
    # causal: position 0 sees itself only
    out = lb.attention(q, k, v, 4, 2, 3, "sdpa")
    assert torch.allclose(out[0].view(2, 2, 2, 3), v[0].view(2, 2, 1, 3).expand(2, 2, 2, 3), atol=1e-6)


def test_heap_estimate():
    assert lb.heap_bytes(lb.LLAMA3_70B, 8192, 2) == int(1.25 * 8 * 8192 * 8192 * 2) + (256 << 20)


def test_arguments():
    a = lb.parse_args(["--quick"])
    assert (a.tokens, a.iters, a.warmup, a.impls) == ([2048], 10, 3, ["flux", "torch", "symm_mem"])
    a = lb.parse_args(["--tokens", "4096,8192", "--impls", "flux", "--warmup", "0"])
    assert (a.tokens, a.impls, a.warmup, a.iters) == ([4096, 8192], ["flux"], 0, 50)
    with pytest.raises(SystemExit):
        lb.parse_args(["--impls", "flux,nccl"])


def test_run_py_delegates_block():
    assert run.block_argv(["--ops", "block", "--quick"]) == ["--quick"]
    assert run.block_argv(["--quick", "--ops=block"]) == ["--quick"]
    assert run.block_argv(["--ops", "ag_gemm"]) is None and run.block_argv([]) is None


def test_table():
    recs = [{"tokens": 2048, "impl": i, "status": "ok", "ok": True, "fwd_ms": f, "fwd_bwd_ms": 3 * f,
             "errors": {"output": 1e-3, "grad qkv.weight": 4e-3}} for i, f in (("flux", 1.0), ("torch", 1.5))]
    recs.append({"tokens": 2048, "impl": "symm_mem", "status": "unavailable: no NCCL", "ok": None})
    table = lb.format_table(recs, header="H")
    assert table.splitlines()[0] == "H"
    flux = next(line for line in table.splitlines() if " flux " in line)
    assert "1.50" in flux and "4.0e-03" in flux and flux.endswith("ok")
    assert "unavailable: no NCCL" in table


@pytest.mark.parametrize("entry", [["benchmarks/llama_block.py"], ["benchmarks/run.py", "--ops", "block"]])
def test_no_gpu_exit(entry):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    proc = subprocess.run([sys.executable, *entry, "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 3 and "no CUDA device visible" in proc.stderr, proc.stderr
