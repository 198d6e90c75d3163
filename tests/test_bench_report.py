"""Record building, table, JSON lines and plot writers of benchmarks/report.py.

All timings here are synthetic, hand-made numbers used only to exercise the
arithmetic and the writers; nothing is measured.
"""
import json

import pytest

from benchmarks import metrics, model, report
from benchmarks.shapes import Problem

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ok(ms, rel_err=1e-3, tol=1e-2):
    return {"status": "ok", "ms": ms, "rel_err": rel_err, "tol": tol, "ok": rel_err <= tol}


def synthetic_fused(op="ag_gemm", world=8):
    if op == "ag_gemm":
        p = Problem(op, "llama3-70b", 8192, 28672, 8192, world)
    else:
        p = Problem(op, "llama3-70b", 8192, 8192, 28672, world)
    impls = {
        "ours": ok(7.5),
        "chunked": ok(9.0),
        "symm_mem": {"status": "unavailable: torch X has no torch.ops.symm_mem.fused_all_gather_matmul",
                     "ms": None, "rel_err": None, "tol": 1e-2, "ok": None},
        "serial": ok(10.0),
        "ours_gemm": ok(7.0),
        "ours_comm": ok(2.0, rel_err=0.0, tol=0.0),
        "cublas": ok(7.2),
        "nccl": ok(3.0, rel_err=0.0, tol=0.0),
    }
    return p, impls


def test_build_record_metrics_hand_computed():
    p, impls = synthetic_fused()
    h = model.Hardware()
    rec = report.build_record(p, impls, hw=h)
    m = rec["metrics"]
    # t_gemm / t_comm come from ours gemm_only / comm only
    assert m["t_gemm_ms"] == 7.0 and m["t_gemm_source"] == "ours_gemm"
    assert m["t_comm_ms"] == 2.0 and m["t_comm_source"] == "ours_comm"
    assert m["speedup"]["ours"] == pytest.approx(10.0 / 7.5)
    assert m["speedup"]["chunked"] == pytest.approx(10.0 / 9.0)
    assert "symm_mem" not in m["speedup"]
    assert m["overlap_eff"]["ours"] == pytest.approx((10.0 - 7.5) / 2.0)
    assert m["overlap_eff"]["chunked"] == pytest.approx((10.0 - 9.0) / 2.0)
    assert m["best_possible_speedup"] == pytest.approx(9.0 / 7.0)
    assert m["limit_attained"]["ours"] == pytest.approx(7.0 / 7.5)
    # per-implementation throughput
    flops = 2 * 8192 * (28672 // 8) * 8192
    assert rec["flops_per_gpu"] == flops
    assert rec["impls"]["ours"]["tflops"] == pytest.approx(metrics.tflops(flops, 7.5))
    assert rec["impls"]["ours_comm"]["bus_gbps"] == pytest.approx(metrics.bus_gbps(8192 * 8192 * 2, 2.0, 8))
    assert "tflops" not in rec["impls"]["ours_comm"]
    assert "bus_gbps" not in rec["impls"]["cublas"]
    # model uses the measured GEMM speed: its t_gemm equals the measured gemm_only time
    assert rec["model"]["t_gemm_ms"] == pytest.approx(7.0)
    assert rec["model"]["err_pct"] == pytest.approx(100 * (rec["model"]["total_ms"] - 7.5) / 7.5)
    assert rec["checks_failed"] == []


def test_fallback_sources_and_failed_check():
    p, impls = synthetic_fused("gemm_rs")
    impls["ours_gemm"] = {"status": "unavailable: AttributeError: no gemm_only", "ms": None, "rel_err": None,
                          "tol": 2e-2, "ok": None}
    impls["ours_comm"] = {"status": "error: RuntimeError: boom", "ms": None, "rel_err": None, "tol": 2e-2,
                          "ok": None}
    impls["ours"] = ok(8.0, rel_err=0.5, tol=2e-2)
    rec = report.build_record(p, impls, hw=None)
    assert rec["metrics"]["t_gemm_source"] == "cublas"
    assert rec["metrics"]["t_comm_source"] == "nccl"
    assert rec["checks_failed"] == ["ours"]
    assert rec["model"] is None
    table = report.format_table([rec])
    assert "FAIL" in table and "unavailable: AttributeError" in table and "error: RuntimeError" in table


def test_world_one_has_no_communication_to_hide():
    p, impls = synthetic_fused(world=1)
    rec = report.build_record(p, impls, hw=model.Hardware(gpus_per_node=1))
    m = rec["metrics"]
    assert m["t_comm_ms"] == 0.0 and m["t_comm_source"] == "none (world 1)"
    assert m["overlap_eff"]["ours"] is None
    assert m["best_possible_speedup"] == pytest.approx(1.0)
    assert m["limit_attained"]["ours"] == pytest.approx(7.0 / 7.5)
    assert m["speedup"]["ours"] == pytest.approx(10.0 / 7.5)
    report.format_table([rec])  # renders with the missing values


def test_comm_record_and_skipped():
    p = Problem("all_gather", "gpt3-175b", 16384, 49152, 12288, 8)
    rec = report.build_record(p, {"ours": ok(1.0, 0.0, 0.0), "nccl": ok(1.25, 0.0, 0.0)}, hw=model.Hardware())
    assert rec["metrics"]["speedup"]["ours"] == pytest.approx(1.25)
    assert rec["impls"]["ours"]["bus_gbps"] == pytest.approx(16384 * 12288 * 2 / 1e-3 / 1e9 * 7 / 8)
    assert rec["model"]["t_gemm_ms"] == 0.0
    sk = report.build_record(Problem("ag_gemm", "llama3-70b", 4096, 28672, 8192, 3), {},
                             skipped="N=28672 is not divisible by world=3")
    assert sk["skipped"].startswith("N=28672")
    table = report.format_table([rec, sk])
    assert "skipped: N=28672" in table
    assert "== AllGather ==" in table and "== AllGather + GEMM ==" in table


def test_table_columns_and_values():
    p, impls = synthetic_fused()
    rec = report.build_record(p, impls, hw=model.Hardware())
    table = report.format_table([rec], header="synthetic header")
    lines = table.splitlines()
    assert lines[0] == "synthetic header"
    head = next(l for l in lines if l.startswith("shape"))
    for col in ("ms", "TFLOP/s", "bus GB/s", "speedup", "overlap", "best", "model ms", "model err%", "check"):
        assert col in head
    ours = next(l for l in lines if "ours (fused)" in l)
    assert "llama3-70b 8192x28672x8192" in ours
    assert "7.500" in ours and "1.33x" in ours and "125%" in ours and "1.29x" in ours
    assert "1.00x" in next(l for l in lines if "NCCL+cuBLAS serial" in l)
    assert "unavailable: torch X" in table


def test_jsonl_roundtrip(tmp_path):
    p, impls = synthetic_fused()
    recs = [{"type": "config", "world": 8}, report.build_record(p, impls, hw=model.Hardware())]
    path = tmp_path / "sub" / "out.jsonl"
    report.write_jsonl(str(path), recs)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        json.loads(line)  # each line is a JSON object
    back = report.read_jsonl(str(path))
    assert back[0] == {"type": "config", "world": 8}
    assert back[1]["metrics"]["speedup"]["ours"] == pytest.approx(10.0 / 7.5)
    assert back[1]["impls"]["symm_mem"]["status"].startswith("unavailable:")
    # non-finite floats are written as null (valid JSON)
    w = report.JsonlWriter(str(tmp_path / "nan.jsonl"))
    w.write({"x": float("inf"), "y": [float("nan")]})
    w.close()
    assert json.loads((tmp_path / "nan.jsonl").read_text()) == {"x": None, "y": [None]}


def test_plots_are_valid_pngs(tmp_path):
    recs = []
    for op in ("ag_gemm", "gemm_rs"):
        p, impls = synthetic_fused(op)
        recs.append(report.build_record(p, impls, hw=model.Hardware()))
    recs.append(report.build_record(Problem("reduce_scatter", "x", 8192, 8192, 28672, 8),
                                    {"ours": ok(1.0), "nccl": ok(1.1)}))
    recs.append(report.build_record(Problem("ag_gemm", "y", 4096, 100, 8192, 3), {}, skipped="not divisible"))
    paths = report.write_plots(recs, str(tmp_path / "plots"), title_suffix="synthetic")
    names = sorted(p.split("/")[-1] for p in paths)
    assert names == ["ag_gemm_overlap.png", "ag_gemm_speedup.png", "gemm_rs_overlap.png", "gemm_rs_speedup.png",
                     "reduce_scatter_bandwidth.png"]
    from PIL import Image

    for path in paths:
        with open(path, "rb") as fh:
            assert fh.read(8) == PNG_MAGIC
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.size[0] > 100 and im.size[1] > 100


def test_progress_bar(capsys):
    import io

    buf = io.StringIO()
    pr = report.Progress(3, stream=buf)
    for i in range(3):
        pr.step(f"item {i}")
    pr.close()
    out = buf.getvalue().splitlines()
    assert out[-1].startswith("[" + "#" * 24 + "] 3/3 item 2")
    quiet = io.StringIO()
    pr = report.Progress(3, stream=quiet, enabled=False)
    pr.step("x")
    assert quiet.getvalue() == ""


def test_fused_gemm_inside_the_call_and_stage_lines():
    p, impls = synthetic_fused("gemm_rs")
    impls["ours_gemm_split"] = ok(7.2)
    impls["ours"] = dict(ok(7.5), fused_gemm_ms=7.35, stages_ms={"fused GEMM (120 CTAs) finished": 7.36,
                                                                  "call done (epoch bumped)": 7.5})
    rec = report.build_record(p, impls, hw=model.Hardware())
    m = rec["metrics"]
    assert m["fused_gemm_ms"] == 7.35 and m["fused_gemm_vs_same_sms"] == pytest.approx(7.35 / 7.2)
    text = report.format_table([rec])
    assert "stages 8192x8192x28672 (ms from call start): fused GEMM (120 CTAs) finished 7.360, call done " \
           "(epoch bumped) 7.500; GEMM inside 7.350 ms = 1.021x gemm_only on the fused SMs" in text
    impls["ours"] = dict(ok(7.5), stages_error="RuntimeError: boom")
    text = report.format_table([report.build_record(p, impls, hw=None)])
    assert "stages 8192x8192x28672: not measured (RuntimeError: boom)" in text
