"""Argument handling and shape sets of benchmarks/run.py and benchmarks/shapes.py, and the no-GPU exit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run, shapes

ROOT = Path(__file__).resolve().parents[1]


def test_parse_shapes_ok():
    assert shapes.parse_shapes("4096x8192x1024") == [(4096, 8192, 1024)]
    assert shapes.parse_shapes(" 1x2x3 , 8192X28672x8192") == [(1, 2, 3), (8192, 28672, 8192)]


@pytest.mark.parametrize("bad", ["", "4096x8192", "4096x8192x", "axbxc", "0x8x8", "8x8x8,", "-8x8x8", "8x8x8x8"])
def test_parse_shapes_errors(bad):
    with pytest.raises(ValueError):
        shapes.parse_shapes(bad)


def test_cli_shapes_and_ops():
    a = run.parse_args(["--shapes", "4096x8192x1024,8192x8192x8192", "--ops", "ag_gemm,gemm_rs"])
    assert a.shapes == [(4096, 8192, 1024), (8192, 8192, 8192)]
    assert a.ops == ["ag_gemm", "gemm_rs"]
    assert (a.iters, a.warmup) == (run.DEFAULT_ITERS, run.DEFAULT_WARMUP)
    a = run.parse_args([])
    assert a.ops == list(shapes.OPS) and a.shapes is None and a.dtype == "bf16" and not a.force_put
    a = run.parse_args(["--dtype", "fp16", "--iters", "7", "--warmup", "0", "--force-put", "--jsonl", "x.jsonl",
                        "--plot-dir", "p"])
    assert (a.dtype, a.iters, a.warmup, a.force_put, a.jsonl, a.plot_dir) == ("fp16", 7, 0, True, "x.jsonl", "p")


@pytest.mark.parametrize("argv", [
    ["--shapes", "4096x8192"],
    ["--shapes", "axbxc"],
    ["--ops", "ag_gemm,bogus"],
    ["--ops", ""],
    ["--dtype", "fp4"],
    ["--iters", "0"],
    ["--warmup", "-1"],
    ["--nvlink-gbps", "0"],
])
def test_cli_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        run.parse_args(argv)
    assert ei.value.code == 2
    assert "error" in capsys.readouterr().err


def test_quick_defaults_and_shapes():
    a = run.parse_args(["--quick"])
    assert a.quick and (a.iters, a.warmup) == (run.QUICK_ITERS, run.QUICK_WARMUP)
    assert run.parse_args(["--quick", "--iters", "3"]).iters == 3
    probs = shapes.build_problems(["ag_gemm", "gemm_rs"], 8, quick=True)
    assert len(probs) == 4 and all(why is None for _, why in probs)
    # two small shapes whose per-GPU GEMM is M x 4096 x 4096 whatever the world
    for p, _ in probs:
        assert p.n_local == 4096 and p.k_local == 4096
    assert sorted({p.m for p, _ in probs}) == [4096, 8192]
    # odd worlds: M rounded up to a multiple of the world
    assert all(why is None for _, why in shapes.build_problems(list(shapes.OPS), 3, quick=True))


def test_default_sweep_and_sharding():
    probs = shapes.build_problems(list(shapes.OPS), 8)
    assert len(probs) == 3 * 2 * 4
    assert all(why is None for _, why in probs)
    ag = next(p for p, _ in probs if p.op == "ag_gemm" and p.label == "llama3-70b" and p.m == 4096)
    assert (ag.n, ag.k, ag.n_local, ag.k_local, ag.m_local) == (28672, 8192, 3584, 8192, 512)
    rs = next(p for p, _ in probs if p.op == "gemm_rs" and p.label == "gpt3-175b" and p.m == 16384)
    assert (rs.n, rs.k, rs.n_local, rs.k_local) == (12288, 49152, 12288, 6144)
    assert rs.flops == 2 * 16384 * 12288 * 6144
    agc = next(p for p, _ in probs if p.op == "all_gather" and p.label == "llama3-70b" and p.m == 4096)
    assert agc.comm_shape == (4096, 8192) and agc.flops == 0
    rsc = next(p for p, _ in probs if p.op == "reduce_scatter" and p.label == "gpt3-175b" and p.m == 4096)
    assert rsc.comm_shape == (4096, 12288)


def test_validation_reasons():
    assert shapes.validate(shapes.Problem("ag_gemm", "c", 4096, 28672, 8192, 3)) is not None  # M % 3
    assert "N=28672" in shapes.validate(shapes.Problem("ag_gemm", "c", 4095, 28672, 8192, 3))
    assert "K=1000" in shapes.validate(shapes.Problem("gemm_rs", "c", 4096, 8192, 1000, 16))
    assert shapes.validate(shapes.Problem("gemm_rs", "c", 4096, 1000, 8192, 8)) is None  # N not split
    assert shapes.validate(shapes.Problem("reduce_scatter", "c", 4096, 1000, 7, 8)) is None
    # world 3 default sweep: invalid configurations are reported, not dropped
    probs = shapes.build_problems(["ag_gemm"], 3)
    assert probs and all(why for _, why in probs)


def test_rotation_sets():
    L2 = 50 * 2**20
    assert shapes.rotation_sets(2**30, L2) == 2  # big sets: minimum 2
    assert shapes.rotation_sets(64 * 2**20, L2) == 4  # ceil(4 * 50 / 64)
    assert shapes.rotation_sets(2**20, L2) == 8  # capped
    assert shapes.rotation_sets(2**30, L2, budget_bytes=2**29) == 1  # budget wins, never 0
    with pytest.raises(ValueError):
        shapes.rotation_sets(0, L2)


def _run_script(script, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=120)


def test_quick_without_gpu_exits_3_with_clear_message():
    r = _run_script("run.py", "--quick")
    assert r.returncode == run.EXIT_NO_GPU == 3, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "no CUDA device visible" in lines[0] and "torch.cuda.is_available() is False" in lines[0]
    assert r.stdout == ""


def test_entry_points_pass_their_op(monkeypatch, capsys):
    # the no-GPU path, without importing torch: main() asks no_gpu_reason() first
    monkeypatch.setattr(run, "no_gpu_reason", lambda: "no CUDA device visible (torch.cuda.is_available() is False)")
    seen = []
    real_parse = run.parse_args
    monkeypatch.setattr(run, "parse_args", lambda argv=None, prog=run.PROG: seen.append(list(argv)) or real_parse(argv))
    from benchmarks import ag_gemm, gemm_rs

    assert ag_gemm.main(["--quick"]) == 3
    assert gemm_rs.main(["--shapes", "8192x8192x28672"]) == 3
    assert seen == [["--ops", "ag_gemm", "--quick"], ["--ops", "gemm_rs", "--shapes", "8192x8192x28672"]]
    assert real_parse(seen[0]).ops == ["ag_gemm"]
    assert "no CUDA device visible" in capsys.readouterr().err


def test_entry_point_script_bad_args_exit_2():
    r = _run_script("ag_gemm.py", "--shapes", "8192x8192")  # argument errors come before any GPU check
    assert r.returncode == 2 and "bad shape" in r.stderr


def test_fp8_problems():
    """--dtype fp8: GEMM+RS with e4m3 operands whose reduce-scatter moves bf16; other ops say why they skip."""
    from benchmarks import shapes
    p = shapes.Problem(op="gemm_rs", label="x", m=1024, n=512, k=2048, world=4, dtype="fp8")
    assert shapes.validate(p) is None
    assert p.elem_bytes == 1 and p.comm_bytes == 1024 * 512 * 2
    ag = shapes.Problem(op="ag_gemm", label="x", m=1024, n=512, k=2048, world=4, dtype="fp8")
    assert "gemm_rs only" in shapes.validate(ag) and ag.comm_bytes == 1024 * 2048
    assert run.parse_args(["--dtype", "fp8", "--ops", "gemm_rs"]).dtype == "fp8"
