"""Issue 36: the fused ops' unfused GEMM (decomposed path, one PE) is ours or cuBLAS by measured records
(flux_shmem/kernels/backends.py): the rule follows the records, falls back to cuBLAS where they lack the GPU, the
SM count or the shape, is part of the agreed planner inputs (so every PE decides alike), and mode 'auto' weighs
the decomposed path with that backend's GEMM."""
from __future__ import annotations

import dataclasses
import json

import pytest

from flux_shmem.errors import SymmetricMismatchError
from flux_shmem.kernels import backends
from flux_shmem.plan import call
from flux_shmem.runtime import symmetric
from flux_shmem.plan.offline import inputs
from test_plan_agreement import _Host

H100 = "NVIDIA H100 80GB HBM3"


def test_shipped_records_cover_the_suites():
    """The H100 file: both families, both layouts, 132 SMs, the tp-shard suite's 56 N x K at M 64 ... 32768."""
    rows = backends._rows(backends.RECORDS_DIR / f"{backends.gpu_slug(H100)}.json")[1]
    assert len(rows) >= 2240
    assert {r[0] for r in rows} == {"ag_gemm", "gemm_rs"} and {r[2] for r in rows} == {"kn", "nk"}
    assert {r[4] for r in rows} >= {64, 128, 256, 512, 1024, 32768} and {r[3] for r in rows} >= {132}
    assert len({(r[5], r[6]) for r in rows}) >= 56


def test_rule_follows_the_records():
    rows = (("nk", 132, 1024, 0.100, 0.110), ("nk", 132, 2048, 0.200, 0.210), ("nk", 132, 4096, 0.400, 0.380),
            ("kn", 132, 1024, 0.100, 0.090))
    ours = backends.choose(rows, 1024, "nk", 132)
    assert ours.name == "ours" and "faster than cuBLAS" in ours.reason and ours.ratio == pytest.approx(1.1)
    mid = backends.choose(rows, 1448, "nk", 132)          # between two records where ours won by >= 3%
    assert mid.name == "ours" and 1.05 < mid.ratio < 1.1
    assert backends.choose(rows, 3000, "nk", 132).name == "cublas"   # one neighbour says cuBLAS
    assert backends.choose(rows, 4096, "nk", 132).name == "cublas"
    assert backends.choose(rows, 1024, "kn", 132).name == "cublas"   # the layout's own records
    tie = (("nk", 132, 512, 0.100, 0.102),)
    assert backends.choose(tie, 512, "nk", 132).name == "cublas"     # within MARGIN: the baseline


def test_rule_falls_back_to_cublas():
    rows = (("nk", 132, 1024, 0.100, 0.200),)
    for m, lay, sms, why in ((64, "nk", 132, "below the records"), (65536, "nk", 132, "above the records"),
                             (1024, "nk", 64, "no record"), (1024, "kn", 132, "no record")):
        b = backends.choose(rows, m, lay, sms)
        assert b.name == "cublas" and why in b.reason, (m, lay, sms, b)
    assert backends.choose((), 1024, "nk", 132).ratio == backends.DEFAULT_RATIO
    assert backends.snapshot(None, "gemm_rs", "bf16", 8192, 3584) == ()
    assert backends.snapshot("An Unknown GPU", "gemm_rs", "bf16", 8192, 3584) == ()
    assert backends.choose(rows, 1024, "nk", 132, force="cublas").name == "cublas"
    assert backends.choose((), 1024, "nk", 132, force="ours").name == "ours"


def test_forced_backend_from_the_environment(monkeypatch):
    monkeypatch.setenv(backends.ENV_FORCE, "CUBLAS")
    assert backends.forced() == "cublas"
    monkeypatch.setenv(backends.ENV_FORCE, "fastest")
    with pytest.raises(ValueError, match="FLUX_SHMEM_PLAIN_GEMM='fastest'"):
        backends.forced()


def test_extra_records_file(tmp_path, monkeypatch):
    """FLUX_SHMEM_GEMM_RECORDS adds (and overrides) rows of this GPU; a bad file names itself and the fix."""
    good = tmp_path / "mine.json"
    good.write_text(json.dumps({"format": backends.FORMAT, "version": 1, "gpu": H100, "fields": list(backends.FIELDS),
                                "rows": [["gemm_rs", "bf16", "nk", 64, 512, 8192, 3584, 0.1, 0.2]]}))
    monkeypatch.setenv(backends.ENV_EXTRA, str(good))
    snap = backends.snapshot(H100, "gemm_rs", "bf16", 8192, 3584)
    assert ("nk", 64, 512, 0.1, 0.2) in snap and any(r[1] == 132 for r in snap)
    assert backends.choose(snap, 512, "nk", 64).name == "ours"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": backends.FORMAT, "version": 1, "gpu": H100, "fields": list(backends.FIELDS),
                               "rows": [["gemm_rs", "bf16", "nk", 64, 512, 8192, 3584, -1, 0.2]]}))
    monkeypatch.setenv(backends.ENV_EXTRA, str(bad))
    with pytest.raises(backends.RecordsError, match="row 0 .* positive sizes and times"):
        backends.snapshot(H100, "gemm_rs", "bf16", 8192, 3584)
    monkeypatch.setenv(backends.ENV_EXTRA, str(tmp_path / "missing.json"))
    with pytest.raises(backends.RecordsError, match="no such file"):
        backends.snapshot(H100, "gemm_rs", "bf16", 8192, 3584)


def test_plans_name_the_backend_and_auto_weighs_it():
    """The decomposed and one-PE plans carry the backend and say why; auto compares the fused prediction with the
    decomposed one whose GEMM time is scaled by the records' ratio (cuBLAS faster: fusing must win by more)."""
    snap = backends.snapshot(H100, "gemm_rs", "bf16", 8192, 3584)
    inp = inputs("gemm_rs", 4, 4, 8192, 3584, 65536, records=snap)
    one = call.plan_call(inputs("gemm_rs", 1, 1, 8192, 3584, 65536, records=snap), 64, "nk", 0)
    assert one.path == "gemm" and one.backend.name == "cublas" and "cuBLAS" in one.describe()
    small = call.plan_call(inp, 64, "nk", 0)
    assert small.path == "decomposed" and small.backend.name == "cublas"
    assert "measured: M = 64: cuBLAS" in small.describe() and "host time" in small.reason
    r = call.plan_call(inp, 8192, "nk", 0).predicted
    b = backends.Backend("cublas", "test", ratio=0.5)       # a cuBLAS twice our speed: decomposed wins
    assert call.auto_path(r, b)[0] == "decomposed"
    assert call.auto_path(r, backends.Backend("ours", "test"))[0] == "fused"
    tiny = dataclasses.replace(r, fused_us=100.0, decomposed_us=130.0, gemm_all_us=100.0)
    assert call.auto_path(tiny, backends.Backend("ours", "t"))[0] == "decomposed"  # host-bound: fusing costs more


def test_the_backend_inputs_are_agreed():
    """Records and FLUX_SHMEM_PLAIN_GEMM are planner inputs: a PE with other records (another GPU model's file, a
    different FLUX_SHMEM_GEMM_RECORDS) or another forced backend raises at construction on every PE."""
    mine = inputs("ag_gemm", 2, 2, 3584, 8192, 8192, records=(("nk", 132, 64, 0.02, 0.01),))
    for theirs in (dataclasses.replace(mine, records=()), dataclasses.replace(mine, plain_gemm="ours")):
        for rank in (0, 1):
            with pytest.raises(SymmetricMismatchError, match=r"PE 0: .*PE 1: "):
                symmetric.agree("planner inputs", [mine, theirs][rank], host=_Host([mine, theirs], rank),
                                timeout_s=1.0)
    plans = [call.plan_call(mine, m, "nk", r) for m in (64, 4096) for r in (0, 1)]
    assert plans[0].backend == plans[1].backend and plans[2].path == plans[3].path
