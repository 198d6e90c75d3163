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
