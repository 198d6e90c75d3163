"""benchmarks/moe.py without a GPU: arguments, the per-GPU shapes of each model, and the no-GPU exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import moe

ROOT = Path(__file__).resolve().parent.parent


def test_models_and_their_shards():
    assert {m: (v.hidden, v.inter, v.experts, v.topk) for m, v in moe.MODELS.items()} == {
        "mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
    assert moe.shard_shapes(moe.MODELS["mixtral-8x7b"], 4, 8192) == (2048, 3584)
    assert moe.shard_shapes(moe.MODELS["qwen3-30b-a3b"], 8, 8192) == (1024, 96)
    with pytest.raises(ValueError, match="--tokens 8191 is not a multiple of the world size 4"):
        moe.shard_shapes(moe.MODELS["deepseek-v3"], 4, 8191)
    with pytest.raises(ValueError, match="does not split over 3 PEs"):
        moe.shard_shapes(moe.MODELS["deepseek-v3"], 3, 8190)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        moe.shard_shapes(moe.MODELS["qwen3-30b-a3b"], 64, 8192)


def test_bad_arguments_exit_2():
    assert moe.main(["--models", "gpt-5"]) == moe.EXIT_USAGE
    assert moe.main(["--routing", "random"]) == moe.EXIT_USAGE
    assert moe.main(["--tokens", "0"]) == moe.EXIT_USAGE


@pytest.mark.parametrize("entry", [["benchmarks/moe.py"], ["benchmarks/run.py", "--ops", "moe"]])
def test_no_gpu_exit(entry):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    proc = subprocess.run([sys.executable, *entry, "--models", "mixtral-8x7b"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 3 and "no CUDA device visible" in proc.stderr, proc.stderr


def test_predict_needs_no_gpu(capsys):
    assert moe.main(["--predict", "2", "--models", "qwen3-30b-a3b", "--routing", "balanced,skewed",
                     "--tokens", "1024"]) == moe.EXIT_OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("moe predict ag qwen3-30b-a3b ") and "(model)" in ln for ln in lines)


def test_block_check_sums_every_pes_shard_part():
    """_check_block's reference at two stand-in PEs (each holding half of every expert's intermediate columns) is
    the unsharded block: the exact output passes, one 1% off reads about 1e-2."""
    gen = torch.Generator().manual_seed(2)
    m, H, inter, E, k = 40, 32, 16, 4, 2
    x = torch.randn(m, H, generator=gen).to(torch.bfloat16)
    ids = torch.topk(torch.randn(m, E, generator=gen), k, dim=1).indices
    wts = torch.softmax(torch.randn(m, k, generator=gen), dim=1)
    w1 = (torch.randn(E, inter, H, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=gen) * 0.2).to(torch.bfloat16)

    def part(cols):  # the block over these intermediate columns, fp64
        out = torch.zeros(m, H, dtype=torch.float64)
        for t in range(m):
            for j in range(k):
                e = int(ids[t, j])
                h = torch.nn.functional.silu(x[t].double() @ w1[e, cols].double().t())
                out[t] += float(wts[t, j]) * (h @ w2[e][:, cols].double().t())
        return out
    lo, hi = slice(0, inter // 2), slice(inter // 2, inter)

    class TwoPEs:  # this PE is 0; PE 1 holds the same tokens and the other half of the columns
        calls = 0

        def allgather(self, obj):
            self.calls += 1
            return [obj, obj] if self.calls == 1 else [obj, [part(hi), part(hi)]]
    full = part(slice(0, inter))
    args = (x, ids, wts, w1[:, lo].contiguous(), w2[:, :, lo].contiguous(), 0, H)
    assert moe._check_block(TwoPEs(), full, *args) < 1e-9
    assert moe._check_block(TwoPEs(), full * 1.01, *args) == pytest.approx(0.01, rel=1e-3)
