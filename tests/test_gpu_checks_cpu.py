"""The GPU checks' `nn` group (tests/gpu/checks.py) run on the CPU, one PE, with stand-ins for the fused ops and
the runtime: the real FusedBackend pool, layers, custom ops and block, so that the check code itself (shapes,
references, assertions) is exercised in CI before it meets a GPU. The CUDA-graph check needs a GPU and is left
to tests/test_gpu.py; torch.compile runs with the aot_eager backend here (inductor on the GPU)."""
from __future__ import annotations

import functools
import importlib.util
import types
from pathlib import Path

import pytest
import torch

import flux_shmem
from flux_shmem.nn import fused
from flux_shmem.runtime import state
from flux_shmem.runtime.topology import Layout

ROOT = Path(__file__).resolve().parents[1]


class OnePE:
    name, rank, size = "test", 0, 1

    def allgather(self, obj):
        return [obj]

    def barrier(self):
        pass

    def barrier_within(self, timeout_s):
        return True


class StandInAG:
    """AllGatherGEMM of a world of one (what the real op does there: the GEMM, and a copy as the gathered a)."""

    def __init__(self, max_m, n, k, dtype, mode="auto", **kw):
        self.max_m, self.n, self.k, self.dtype = max_m, n, k, dtype
        self.ag = types.SimpleNamespace(gather=torch.empty(max_m, k, dtype=dtype))

    def __call__(self, a, b, bias=None, *, return_gathered=False):
        assert a.dtype == b.dtype == self.dtype and tuple(b.shape) == (self.k, self.n) and a.shape[0] <= self.max_m
        assert a.is_contiguous() and (b.is_contiguous() or b.t().is_contiguous())
        out = a @ b if bias is None else a @ b + bias
        return (out, a.clone()) if return_gathered else out


class StandInRS(StandInAG):
    def __init__(self, max_m, n, k, dtype, mode="auto", **kw):
        super().__init__(max_m, n, k, dtype)
        self.engine = types.SimpleNamespace(partial=torch.empty(max_m, n, dtype=dtype))

    def __call__(self, a, b, bias=None):
        return super().__call__(a, b, bias)


@pytest.fixture
def checks(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "tests/gpu/checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import nn_checks  # (tests/gpu is on sys.path now: the checks module put it there)
    monkeypatch.setattr(nn_checks, "DEVICE", "cpu")
    monkeypatch.setattr(nn_checks, "NN_DTYPES", (torch.bfloat16,))  # bf16/fp16 matmuls are slow on this CPU: one
    monkeypatch.setattr(nn_checks, "NN_LAYER_SHAPES",                # dtype, a smaller first shape
                        [(32, 2, 128, 128)] + nn_checks.NN_LAYER_SHAPES[1:])
    import flux_shmem.ops.ag_gemm as ag_mod
    import flux_shmem.ops.gemm_rs as rs_mod
    from flux_shmem.nn import layers
    monkeypatch.setattr(ag_mod, "AllGatherGEMM", StandInAG)
    monkeypatch.setattr(rs_mod, "GEMMReduceScatter", StandInRS)
    real = fused.why_unsupported
    monkeypatch.setattr(fused, "why_unsupported", lambda dev, *a: real("cuda", *a))  # CPU tensors pass as CUDA
    monkeypatch.setattr(layers, "_default_device", lambda: None)
    monkeypatch.setattr(flux_shmem, "barrier", lambda stream=None: None, raising=False)
    monkeypatch.setattr(flux_shmem, "check_errors", lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    rt = state.Runtime(host=OnePE(), layout=Layout(0, 1, 0, 1, 0, 1), device=0, node_size=1, reachable=(True,),
                       force_put=False, timeout_s=5.0, trap_on_timeout=True, shares_gpu=False)
    state.set_runtime(rt)
    yield mod, rt
    state.set_runtime(None)


@pytest.mark.parametrize("name", ["nn_layers", "nn_ops_grow_with_m", "nn_fallback", "nn_block", "nn_block_compiled"])
def test_nn_check_on_cpu(checks, name):
    mod, rt = checks
    fn = next(f for f in mod.CHECKS["nn"] if f.__name__ == name)
    fn(rt)


def test_every_nn_check_is_covered(checks):
    mod, _ = checks
    names = {f.__name__ for f in mod.CHECKS["nn"]}
    assert names == {"nn_layers", "nn_ops_grow_with_m", "nn_fallback", "nn_block", "nn_block_compiled",
                     "nn_graph_train_step"}


def test_torchrun_check_fixed_step_on_cpu(checks, monkeypatch, tmp_path):
    mod, rt = checks
    monkeypatch.setitem(__import__("sys").modules, "checks", mod)  # torchrun_check imports the checks module
    spec = importlib.util.spec_from_file_location("torchrun_check", ROOT / "tests/gpu/torchrun_check.py")
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    a, b = tc.fixed_step(rt), tc.fixed_step(rt)
    assert len(a) == 2 + 8 and set(tc.compare(a, b).values()) == {0.0}  # deterministic
    b["output"] = b["output"] * 1.01
    assert tc.compare(a, b)["output"] == pytest.approx(0.01 / 1.01, rel=1e-2)


def test_gpu_tests_count_exactly_the_checks_of_their_groups():
    """Issue 37: tests/test_gpu.py passes a launch only when every check of its groups printed exactly one
    `CHECK <name> ok` or `CHECK <name> skip: <reason>` line (info and note lines do not count), the exit status
    was 0 and nothing failed."""
    import subprocess
    from test_gpu import assert_checks_passed, expected_checks
    names = expected_checks(["gemm", "hazards"])
    spec = importlib.util.spec_from_file_location("c", ROOT / "tests/gpu/checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert names == [f.__name__ for f in mod.CHECKS["gemm"] + mod.CHECKS["hazards"]] and len(names) >= 8

    def proc(lines, rc=0):
        p = subprocess.CompletedProcess([], rc, "\n".join(lines) + "\n", "")
        p.groups = ("gemm", "hazards")
        return p
    good = [f"CHECK {n} ok (1.0 s, world 2)" for n in names[:-1]] + [f"CHECK {names[-1]} skip: needs 2 or more PEs"]
    assert_checks_passed(proc(good + ["CHECK info: something", "CHECK note: more"]))
    for bad in (good[:-1] + ["CHECK info: x"] * 3,             # a check missing (info lines do not count)
                good + [good[0]],                              # a check reported twice
                good[:-1] + [f"CHECK {names[-1]} skip"]):       # a skip without its reason
        with pytest.raises(AssertionError):
            assert_checks_passed(proc(bad))
    with pytest.raises(AssertionError):
        assert_checks_passed(proc(good, rc=1))
    with pytest.raises(AssertionError):
        assert_checks_passed(proc(good + [f"CHECK {names[0]} FAILED on PE 1:"]))
