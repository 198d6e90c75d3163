"""The tp-shard suite (benchmarks/shapes.py): per-GPU GEMMs of tensor parallelism, deduplicated, TMA-aligned, with
the shapes the issue measured; the quick subset; run.py and gemm_tune.py take it by name; the issue's summary lines."""
from __future__ import annotations

import pytest

from benchmarks import shapes


def test_suite_is_deduplicated_and_aligned():
    full = shapes.tp_shard_suite()
    keys = [(s.m, s.n, s.k) for s in full]
    assert len(keys) == len(set(keys))
    assert all(s.n % 8 == 0 and s.k % 8 == 0 for s in full)  # 16-byte rows for TMA (bf16/fp16)
    assert {s.m for s in full} == set(shapes.TP_SHARD_MS)
    assert all(p in ("column", "row") for s in full for p in s.parallel)
    # every origin is model/layer/tpN with a layer of the list, every model and TP size is present
    origins = [o.split("/") for s in full for o in s.origins]
    assert {o[0] for o in origins} == set(shapes.MODELS)
    assert {o[1] for o in origins} == {"qkv", "o_proj", "up", "gate_up", "down"}
    assert {o[2] for o in origins} == {"tp2", "tp4", "tp8"}
    # the same shard of two models counts once (Mixtral's attention and expert = Llama-3 8B's)
    s = next(x for x in full if x.shape == "8192x1536x4096")
    assert "llama3-8b/qkv/tp4" in s.origins and "mixtral-8x7b/qkv/tp4" in s.origins


def test_suite_holds_the_issue_shapes():
    have = {s.shape: s for s in shapes.tp_shard_suite()}
    for shape, origin in (("16384x3584x8192", "llama3-70b/up/tp8"), ("8192x7168x8192", "llama3-70b/gate_up/tp8"),
                          ("8192x1280x8192", "llama3-70b/qkv/tp8"), ("8192x12288x6144", "gpt3-175b/down/tp8"),
                          ("8192x8192x3584", "llama3-70b/down/tp8"), ("4096x3584x8192", "llama3-70b/up/tp8")):
        assert origin in have[shape].origins, shape
    # column-parallel shards split N, row-parallel ones K
    assert "column" in have["8192x1280x8192"].parallel and "row" in have["8192x8192x3584"].parallel


def test_shard_arithmetic():
    llama70 = shapes.MODELS["llama3-70b"]
    layers = {name: (par, n, k) for name, par, n, k in llama70.layers()}
    assert layers == {"qkv": ("column", 10240, 8192), "o_proj": ("row", 8192, 8192), "up": ("column", 28672, 8192),
                      "gate_up": ("column", 57344, 8192), "down": ("row", 8192, 28672)}
    assert "gate_up" not in {name for name, *_ in shapes.MODELS["gpt3-175b"].layers()}
    s = shapes.ShardShape(8192, 1280, 8192, ("x",), ("column",))
    assert s.global_for("ag_gemm", 8) == (8192, 10240, 8192) and s.global_for("gemm_rs", 8) == (8192, 1280, 65536)


def test_quick_subset():
    quick = shapes.tp_shard_quick()
    assert 16 <= len(quick) <= 24
    names = [s.shape for s in quick]
    assert len(set(names)) == len(names)
    for must in ("8192x1280x8192", "8192x3584x8192", "16384x3584x8192", "8192x7168x8192", "4096x3584x8192"):
        assert must in names
    # it spans the regimes: under one wave of 128x256 tiles on 132 SMs, a few waves, many
    waves = [(-(-s.m // 256)) * (-(-s.n // 256)) / 66 for s in quick]
    assert min(waves) < 1 and max(waves) > 20 and any(1 < w < 3 for w in waves)


def test_suites_by_name():
    assert isinstance(shapes.parse_shapes("tp-shard"), shapes.SuiteName)
    assert len(shapes.suite("tp-shard-quick")) == len(shapes.tp_shard_quick())
    with pytest.raises(ValueError, match="unknown shape suite"):
        shapes.suite("nope")
    assert shapes.parse_shapes("8x8x8") == [(8, 8, 8)]


def test_run_py_takes_the_suite():
    from benchmarks import run
    args = run.parse_args(["--shapes", "tp-shard-quick", "--ops", "ag_gemm,gemm_rs"])
    probs = shapes.build_problems(args.ops, 8, shapes=args.shapes)
    assert probs and all(why is None for _, why in probs)
    quick = {s.shape: s for s in shapes.tp_shard_quick()}
    for p, _ in probs:
        per_gpu = f"{p.m}x{p.n_local}x{p.k_local}"
        assert per_gpu in quick
        assert ("column" if p.op == "ag_gemm" else "row") in quick[per_gpu].parallel
    assert {p.op for p, _ in probs} == {"ag_gemm", "gemm_rs"}


def test_gemm_tune_shape_list():
    from benchmarks import gemm_tune
    assert len(gemm_tune.shape_list("tp-shard-quick")) == len(shapes.tp_shard_quick())
    assert gemm_tune.shape_list("1x8x8,2x8x8") == [(1, 8, 8), (2, 8, 8)]


def test_summary_lines_format():
    from benchmarks import gemm_shapes
    rows = [dict(family="ag_gemm", layout="nk", kind="heuristic", shape="8192x1280x8192", ratio=0.9),
            dict(family="ag_gemm", layout="nk", kind="heuristic", shape="8192x3584x8192", ratio=1.0),
            dict(family="ag_gemm", layout="nk", kind="tuned", shape="8192x1280x8192", ratio=1.02)]
    lines = gemm_shapes.summary_lines(rows, ["ag_gemm", "gemm_rs"], ["kn", "nk"])
    assert lines == ["tp-shard ag_gemm nk: geomean 0.949, min 0.900 at 8192x1280x8192 (heuristic)",
                     "tp-shard ag_gemm nk: geomean 1.020, min 1.020 at 8192x1280x8192 (tuned)"]
    fused = gemm_shapes.fused_lines([dict(layout="nk", sm_count=132, shape="8192x3584x8192", ratio=0.99)])
    assert fused == ["fused-mainloop ag_gemm nk sm132: min 0.990 at 8192x3584x8192, geomean 0.990 "
                     "(gemm_only ms / fused ms)"]


def test_cublas_choice_summary():
    """--cublas-kernels' summary of cuBLAS's kernel names (what cuBLAS chose, to compare with our choice)."""
    from benchmarks import gemm_shapes
    name = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cluster2x1x1_warpgroupsize2x1x1_"
            "execute_segment_k_off_kernel__5x_cublas")
    assert gemm_shapes.cublas_choice(name) == "tile 128x256x64 cluster 2x1x1 warpgroups 2x1x1 segment_k off"
    assert gemm_shapes.cublas_choice("sm90_xmma_gemm_f16_streamk_tilesize64x128x64_kernel") == \
        "tile 64x128x64 streamk"
    assert gemm_shapes.cublas_choice("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == \
        "nvjet tile 256x128 k64x4 cluster 2x1 coopA"
    assert gemm_shapes.cublas_choice("ampere_bf16_s16816gemm") == "ampere_bf16_s16816gemm"
    assert gemm_shapes.parse_args(["--cublas-kernels"]).cublas_kernels


def test_suite_parts_and_merged_summary(tmp_path, capsys):
    """The whole tp-shard suite over several device calls: --part I/N splits it (every shape once), --summarize
    merges the parts' JSONL files into the issue's lines without a GPU."""
    import json
    from benchmarks import gemm_shapes
    full = shapes.tp_shard_suite()
    parts = [gemm_shapes.part_of(full, (i, 3)) for i in range(3)]
    assert sorted(s.shape for p in parts for s in p) == sorted(s.shape for s in full)
    assert gemm_shapes.parse_args(["--part", "1/3"]).part == (1, 3)
    with pytest.raises(SystemExit):
        gemm_shapes.parse_args(["--part", "3/3"])
    files = []
    for i, (shape, ratio) in enumerate((("8192x1280x8192", 0.9), ("8192x3584x8192", 1.0))):
        f = tmp_path / f"p{i}.jsonl"
        f.write_text(json.dumps(dict(type="result", family="ag_gemm", layout="nk", kind="heuristic", shape=shape,
                                     ratio=ratio)) + "\n")
        files.append(str(f))
    assert gemm_shapes.main(["--summarize", *files]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["# 2 shapes from 2 file(s)",
                   "tp-shard ag_gemm nk: geomean 0.949, min 0.900 at 8192x1280x8192 (heuristic)"]
