"""FP8 (e4m3) GEMMs on the CPU (issue 26): argument checks and scale layouts of kernels.gemm.gemm, the chooser and
the build keys for e4m3, and the GEMM families' fp8 build (one configuration, both families) compiled with nvcc:
cubin with fp8 wgmma (QGMMA), host library ABI, scale and alignment errors from the host functions.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from flux_shmem.errors import BuildError, FluxShmemError
from flux_shmem.kernels import build as kb
from flux_shmem.kernels import config
from flux_shmem.kernels import gemm as kg
from flux_shmem.kernels import plain
from flux_shmem.kernels import registry

FAMILIES = ("ag_gemm", "gemm_rs")
E4M3 = torch.float8_e4m3fn

pytestmark = pytest.mark.timeout(3600)


def _ops(m=64, n=48, k=32, *, dtype=E4M3, layout="nk", device="cpu"):
    a = torch.zeros(m, k, dtype=dtype, device=device)
    b = torch.zeros(n, k, dtype=dtype, device=device).t() if layout == "nk" else torch.zeros(k, n, dtype=dtype,
                                                                                            device=device)
    return a, b


def _f32(*shape, device="cpu"):
    return torch.ones(tuple(shape), dtype=torch.float32, device=device)


# --- scale layouts and argument checks (no GPU, no build) ------------------------------------------------------------

@pytest.mark.parametrize("sa_shape,sb_shape,kind", [
    ((), (), 0), ((1,), (1,), 0), ((1, 1), (), 0),
    ((64,), (48,), kg.SCALE_ROWWISE_A | kg.SCALE_ROWWISE_B), ((64, 1), (1, 48), 3),
    ((64, 1), (), kg.SCALE_ROWWISE_A), ((), (1, 48), kg.SCALE_ROWWISE_B),
])
def test_scale_layouts_normalised(sa_shape, sb_shape, kind):
    a, b = _ops()
    sa, sb, got = kg.fp8_scales(a, b, _f32(*sa_shape), _f32(*sb_shape))
    assert got == kind
    assert sa.dim() == 1 and sb.dim() == 1 and sa.dtype == sb.dtype == torch.float32
    assert sa.numel() == (64 if kind & kg.SCALE_ROWWISE_A else 1)
    assert sb.numel() == (48 if kind & kg.SCALE_ROWWISE_B else 1)


def test_scales_are_views_of_the_callers_tensors():
    a, b = _ops()
    s = _f32(64, 1)
    sa, _, _ = kg.fp8_scales(a, b, s, _f32())
    assert sa.data_ptr() == s.data_ptr()  # the kernel reads the caller's memory: no temporary to outlive


@pytest.mark.parametrize("kw,match", [
    (dict(scale_a=None), "need scale_a and scale_b"),
    (dict(scale_b=None), "torch.ones"),
    (dict(scale_a=_f32().double()), "scale_a must be float32"),
    (dict(scale_b=torch.ones((), dtype=torch.bfloat16)), r"scale_b must be float32, got torch.bfloat16: pass"),
    (dict(scale_a=_f32(48)), r"scale_a has shape \(48,\); use \[\] or \[1\] \(per-tensor\) or \[64\] or \[64, 1\]"),
    (dict(scale_a=_f32(1, 64)), r"scale_a has shape \(1, 64\)"),
    (dict(scale_b=_f32(48, 1)), r"scale_b has shape \(48, 1\).*\[48\] or \[1, 48\] \(rowwise: one per column"),
    (dict(scale_b=_f32(2)), "scale_b has shape"),
    (dict(scale_a=1.0), "must be a torch.Tensor of fp32"),
    (dict(scale_a=torch.ones(64, 2)[:, 0:1]), r"scale_a must be contiguous: pass scale_a.contiguous\(\)"),
    (dict(out_dtype=torch.float16), "output torch.bfloat16"),
    (dict(bias=torch.zeros(48, dtype=torch.float16)), r"bias must be \[48\] of the output dtype"),
    (dict(bias=torch.zeros(64, dtype=torch.bfloat16)), r"bias must be \[48\]"),
])
def test_argument_errors_name_the_fix(kw, match):
    a, b = _ops()
    args = dict(scale_a=_f32(), scale_b=_f32())
    args.update(kw)
    bias, out_dtype = args.pop("bias", None), args.pop("out_dtype", None)
    with pytest.raises(FluxShmemError, match=match):
        kg.fp8_scales(a, b, args["scale_a"], args["scale_b"], out_dtype=out_dtype, bias=bias)


def test_scale_on_another_device():
    a, b = _ops(device="meta")
    with pytest.raises(FluxShmemError, match=r"scale_a is on cpu but a is on meta: pass scale_a.to\('meta'\)"):
        kg.fp8_scales(a, b, _f32(), _f32(device="meta"))


def test_operand_dtypes_and_layout():
    a, b = _ops()
    e5a, _ = _ops(dtype=torch.float8_e5m2)
    with pytest.raises(FluxShmemError, match="float8_e5m2.*cast to float8_e4m3fn"):
        kg.fp8_scales(e5a, b, _f32(), _f32())
    with pytest.raises(FluxShmemError, match="must both be float8_e4m3fn.*torch.bfloat16"):
        kg.fp8_scales(a, b.to(torch.bfloat16), _f32(), _f32())
    _, b_kn = _ops(layout="kn")
    with pytest.raises(FluxShmemError, match=r"\[N, K\] row-major \('nk', K contiguous\).*transpose"):
        kg.fp8_scales(a, b_kn, _f32(), _f32())
    with pytest.raises(FluxShmemError, match="do not multiply"):
        kg.fp8_scales(a, _ops(k=16)[1], _f32(), _f32())


def test_gemm_checks_before_touching_a_gpu():
    """kernels.gemm.gemm raises its argument errors first, so they read the same on a machine without a GPU."""
    a, b = _ops()
    with pytest.raises(FluxShmemError, match="need scale_a and scale_b"):
        plain.gemm(a, b)
    with pytest.raises(FluxShmemError, match="cast to float8_e4m3fn"):
        plain.gemm(a.to(torch.float8_e5m2), b, scale_a=_f32(), scale_b=_f32())
    with pytest.raises(FluxShmemError, match="'nk'"):
        plain.gemm(a, _ops(layout="kn")[1], scale_a=_f32(), scale_b=_f32())
    a16, b16 = _ops(dtype=torch.bfloat16)
    with pytest.raises(FluxShmemError, match="scale_a/scale_b are for float8_e4m3fn operands"):
        plain.gemm(a16, b16, scale_a=_f32(), scale_b=_f32())


def test_fused_fp8_dtype_checks():
    """Both fused ops take e4m3 (their checks pass, so construction reaches the runtime, absent here); e5m2 and
    misaligned K are the caller's errors."""
    import flux_shmem
    for op in (flux_shmem.AllGatherGEMM, flux_shmem.GEMMReduceScatter):
        with pytest.raises(TypeError, match="cast to torch.float8_e4m3fn"):
            op(1024, 1024, 1024, torch.float8_e5m2)
        with pytest.raises(ValueError, match="K = 1000 is not a multiple of 16"):
            op(1024, 1024, 1000, E4M3)
        with pytest.raises(Exception) as e:
            op(1024, 1024, 1024, E4M3)
        assert "init" in str(e.value), e.value  # past every dtype check: the runtime is what is missing


def test_fused_fp8_scale_checks():
    """FusedGEMM.check_scales: fp8 ops need both scales in torch._scaled_mm's layouts (rowwise kinds set),
    16-bit ops reject them, each error naming the op and the fix."""
    from types import SimpleNamespace
    from flux_shmem.ops._fused import FusedGEMM
    a, b = _ops()
    m, n = a.shape[0], b.shape[1]
    fp8, b16 = SimpleNamespace(fp8=True, dtype=E4M3), SimpleNamespace(fp8=False, dtype=torch.bfloat16)
    assert FusedGEMM.check_scales(fp8, a, b, _f32(), _f32(), "op")[2] == 0
    sa, sb = torch.rand(m), torch.rand(n)
    _, _, kind = FusedGEMM.check_scales(fp8, a, b, sa, sb, "op")
    assert kind == kg.SCALE_ROWWISE_A | kg.SCALE_ROWWISE_B
    with pytest.raises(ValueError, match="op: .*need scale_a and scale_b"):
        FusedGEMM.check_scales(fp8, a, b, None, _f32(), "op")
    with pytest.raises(ValueError, match="op: .*scale_a has shape"):
        FusedGEMM.check_scales(fp8, a, b, torch.rand(m + 1), _f32(), "op")
    with pytest.raises(ValueError, match="op: .*float32"):
        FusedGEMM.check_scales(fp8, a, b, _f32().half(), _f32(), "op")
    with pytest.raises(ValueError, match="scale_a/scale_b are for float8_e4m3fn.*dtype=torch.float8_e4m3fn"):
        FusedGEMM.check_scales(b16, a, b, _f32(), _f32(), "op")
    assert FusedGEMM.check_scales(b16, a, b, None, None, "op") == (0, 0, 0)


def test_fp8_planner_inputs():
    """The planner models an fp8 GEMM at FP8_SPEEDUP times the bf16 rate; GEMM+RS plans its 16-bit partials."""
    from flux_shmem.plan import inputs
    g16, g8 = inputs.gemm_model(4096), inputs.gemm_model(4096, dtype="e4m3")
    assert g8.tile_us == pytest.approx((g16.tile_us - inputs.TILE_FIXED_US) / config.FP8_SPEEDUP +
                                       inputs.TILE_FIXED_US)


# --- the chooser ---------------------------------------------------------------------------------------------------

def test_dtype_names():
    assert config.dtype_name(E4M3) == "e4m3" == config.dtype_name("e4m3") == config.dtype_name("float8_e4m3fn")
    assert "e4m3" in config.DTYPES and "e4m3" in kg.DTYPE_NAMES
    with pytest.raises(FluxShmemError, match="cast to float8_e4m3fn"):
        config.dtype_name(torch.float8_e5m2)
    with pytest.raises(FluxShmemError, match=r"bfloat16 or float16 operands \(or float8_e4m3fn with scales\)"):
        config.dtype_name(torch.float32)
    assert config.elem_bytes("e4m3") == (1, 2) and config.elem_bytes("bf16") == (2, 2)


def test_kernel_names():
    assert kg.kernel_name("gemm_rs", "e4m3", "nk") == "fs_gemm_rs_e4m3_nk"
    assert kg.kernel_name("ag_gemm", "e4m3", "nk") == "fs_ag_gemm_e4m3_nk"
    with pytest.raises(FluxShmemError, match="'nk'"):
        kg.kernel_name("gemm_rs", "e4m3", "kn")


def test_chooser_on_fp8(monkeypatch):
    """The registry's configurations serve e4m3 too (those whose accumulators fit): K-tiles of 128, twice the rate."""
    monkeypatch.delenv(kb.ENV_FP8_FAST_ACCUM, raising=False)
    assert registry.tile_k("e4m3") == 128 and registry.tile_k("bf16") == registry.TILE_K == 64
    for m, n, k in ((8192, 8192, 8192), (8192, 1280, 8192), (1024, 768, 4096), (128, 7168, 2048)):
        ch = config.choose(m, n, k, E4M3, "nk", 132, use_cache=False)
        assert ch.config in registry.names_for("e4m3") and ch.source == "heuristic"
        assert 1 <= ch.split <= registry.get(ch.config).max_splits
        cfg = registry.get(registry.default_for("e4m3"))
        e8 = config.estimate(cfg, m, n, k, 132, dtype="e4m3")
        e16 = config.estimate(cfg, m, n, k, 132, dtype="bf16")
        assert e8.us < e16.us and e8.tiles == e16.tiles
    # splits are bounded by the fp8 K-tiles: k = 256 is 2 K-tiles of 128 (4 of 64 for bf16)
    cfg = registry.get("128x128_c2x1")
    assert max(config._split_options(cfg, 128, 256, 256, 132, "e4m3")) == 2
    assert max(config._split_options(cfg, 128, 256, 256, 132, "bf16")) == 4
    with pytest.raises(FluxShmemError, match="'nk'"):
        config.choose(1024, 1024, 1024, "e4m3", "kn", 132, use_cache=False)
    # the heuristic's cache keeps dtypes apart
    a = config.heuristic(8192, 1280, 256, "e4m3", "nk", 132)
    b = config.heuristic(8192, 1280, 256, "bf16", "nk", 132)
    assert a.estimate_us != b.estimate_us


def test_fp8_configurations_that_fit_in_registers(monkeypatch):
    """The promoting fp8 schedule holds two accumulators: only tiles of <= 64 registers each run without spilling
    (the 128x256 build spilled 365 local stores and ran at 0.36x torch._scaled_mm); FP8FastAccum holds one."""
    monkeypatch.delenv(kb.ENV_FP8_FAST_ACCUM, raising=False)
    regs = {n: registry.get(n).accumulator_regs for n in registry.names()}
    assert regs == {"128x256_c2x1": 128, "256x128_c1x2": 128, "128x128_c2x1": 64, "128x128_c2x1_pp": 128}
    assert registry.names_for("e4m3") == ("128x128_c2x1",) == tuple(n for n in registry.names() if regs[n] <= 64)
    assert registry.default_for("e4m3") == "128x128_c2x1" and registry.default_for("bf16") == registry.DEFAULT
    assert registry.names_for("bf16") == registry.names_for("fp16") == registry.names()
    for m, n, k in ((8192, 3584, 8192), (1024, 768, 4096)):  # the heuristic and the whole chooser alike
        assert config.heuristic(m, n, k, "e4m3", "nk", 132).config == "128x128_c2x1"
    with pytest.raises(FluxShmemError, match="FLUX_SHMEM_FP8_FAST_ACCUM=1"):
        config.choose(8192, 3584, 8192, "e4m3", "nk", 132, configs=["128x256_c2x1"], use_cache=False)
    assert config.choose(8192, 3584, 8192, "bf16", "nk", 132, configs=["128x256_c2x1"],
                         use_cache=False).config == "128x256_c2x1"
    monkeypatch.setenv(kb.ENV_FP8_FAST_ACCUM, "1")
    assert registry.names_for("e4m3") == registry.names() and registry.default_for("e4m3") == registry.DEFAULT
    assert config.choose(8192, 3584, 8192, "e4m3", "nk", 132, configs=["128x256_c2x1"],
                         use_cache=False).config == "128x256_c2x1"


def test_tune_cache_keys_accept_e4m3():
    from flux_shmem.kernels import tune_cache
    assert tune_cache._KEY_RE.match("NVIDIA H100|sm132|cuda13.0|e4m3|nk|8192x1280x8192")


# --- build keys ----------------------------------------------------------------------------------------------------

def test_fp8_build_is_keyed_apart(monkeypatch):
    monkeypatch.delenv(kb.ENV_FP8_FAST_ACCUM, raising=False)
    for fam in FAMILIES:
        k16, k8 = kb.cache_key(fam, "90a"), kb.cache_key(fam, "90a", fp8=True)
        assert k16 != k8 and "-e4m3" in k8 and "e4m3" not in k16
        assert kb.cache_key(fam, "90a", "128x128_c2x1_pp", fp8=True) not in (k8, kb.cache_key(fam, "90a",
                                                                                             "128x128_c2x1_pp"))
        monkeypatch.setenv(kb.ENV_FP8_FAST_ACCUM, "1")
        kf = kb.cache_key(fam, "90a", fp8=True)
        assert kf != k8 and "fastacc" in kf and kb.cache_key(fam, "90a") == k16  # 16-bit builds ignore it
        monkeypatch.delenv(kb.ENV_FP8_FAST_ACCUM)
    cfg = registry.get(None)
    flags = kb._flags(cfg, fp8=True)
    assert "-DFS_GEMM_FP8=1" in flags and "-DFS_GEMM_TILE_K=128" in flags and "-DFS_GEMM_FP8_FAST_ACCUM=0" in flags
    assert not any("FP8" in f or "TILE_K" in f for f in kb._flags(cfg))
    with pytest.raises(BuildError, match="no fp8 build"):
        kb.cache_key("collectives", "90a", fp8=True)


def test_build_cli_targets_fp8():
    from flux_shmem import build as cli
    t = cli._targets(["gemm_rs", "collectives"], None, ("90a",), fp8=True)
    e4m3 = registry.default_for("e4m3")
    assert ("gemm_rs", e4m3, "90a", True) in t and ("gemm_rs", registry.DEFAULT, "90a", False) in t
    assert ("gemm_rs", registry.DEFAULT, "90a", True) not in t  # (it spills under the promoting schedule)
    # --config all: every 16-bit configuration, the fp8 builds of those the chooser runs for e4m3
    every = cli._targets(["gemm_rs"], ["all"], ("90a",), fp8=True)
    assert {c for _, c, _, f in every if f} == set(registry.names_for("e4m3"))
    assert {c for _, c, _, f in every if not f} == set(registry.names())
    assert ("collectives", None, "90a", False) in t and ("collectives", None, "90a", True) not in t
    assert all(not f for *_, f in cli._targets(["gemm_rs"], None, ("90a",)))


def _cuobjdump() -> str | None:
    """As tests/test_gemm_build.py: a cuobjdump that can disassemble, or None."""
    cands = [shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    cands += [str(p) for p in Path(sysconfig.get_paths()["purelib"]).glob("nvidia/cu*/bin/cuobjdump")]
    return next((c for c in cands if c and os.path.exists(c)), None)


def _tool_env(tool: str) -> dict:
    return {**os.environ, "PATH": str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", "")}


# --- the fp8 build of both families, one configuration (nvcc, about a minute each on 2 cores) -----------------------

@pytest.fixture(scope="module")
def fp8_builds():  # the configuration the chooser runs fp8 with (promoting schedule)
    return {fam: kb.build(fam, "90a", config=registry.default_for("e4m3"), fp8=True) for fam in FAMILIES}


@pytest.fixture(scope="module")
def fp8_libs(fp8_builds):
    return {fam: ctypes.CDLL(str(art.host_lib)) for fam, art in fp8_builds.items()}


def _args(fam, **kw):
    base = dict(m=8192, n=1280, k=8192, a=0x10000, b=0x20000, d=0x30000, sm_count=132, scale_a=0x40000,
                scale_b=0x50000)
    base.update(kw)
    return kg.ARGS_TYPE[fam](**base)


def test_fp8_build_holds_the_e4m3_kernels(fp8_builds, fp8_libs):
    for fam, art in fp8_builds.items():
        assert art.fp8
        data = art.cubin.read_bytes()
        assert f"fs_{fam}_e4m3_nk".encode() in data
        assert f"fs_{fam}_bf16_nk".encode() not in data  # the fp8 build is the e4m3 kernels only
        lib = fp8_libs[fam]
        kg.check_abi(lib)
        h = kg.GemmHost(lib, fam, "e4m3", "nk")
        assert h.fp8 and not h.fast_accum and h.tile_k == 128 and h.tile_shape == (128, 128)
        assert h.config.name == registry.default_for("e4m3") and 0 < h.params_size <= 4096
        with pytest.raises(BuildError, match="fp8 build, which has no fs_.*_bf16_nk"):
            kg.GemmHost(lib, fam, "bf16", "nk")
        assert not hasattr(lib, f"fs_{fam}_bf16_nk_params")


def test_fp8_host_errors(fp8_libs):
    for fam, lib in fp8_libs.items():
        h = kg.GemmHost(lib, fam, "e4m3", "nk")
        with pytest.raises(FluxShmemError, match="fp8 kernels need scale_a and scale_b"):
            h.params(_args(fam, scale_a=None))
        with pytest.raises(FluxShmemError, match="fp8 kernels need scale_a and scale_b"):
            h.params(_args(fam, scale_b=None))
        with pytest.raises(FluxShmemError, match="scale_kind=4"):
            h.params(_args(fam, scale_kind=4))
        with pytest.raises(FluxShmemError, match="k=8200 must be a multiple of 16 and n=1280 of 8"):
            h.params(_args(fam, k=8200))
        with pytest.raises(FluxShmemError, match="k=8192 must be a multiple of 16 and n=1284 of 8"):
            h.params(_args(fam, n=1284))
        # K-tiles of 128: k = 256 has 2
        with pytest.raises(FluxShmemError, match="splits=4 exceeds the 2 K-tiles of k=256"):
            h.workspace_size(_args(fam, k=256, splits=4))
        assert h.workspace_size(_args(fam)) == 0
        assert h.workspace_size(_args(fam, splits=2)) == 64 * 1024 + 66 * 2 * h.tile_shape[0] * h.tile_shape[1] * 4
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:  # valid arguments reach the TMA descriptors, which need the driver
            with pytest.raises(FluxShmemError, match="libcuda"):
                h.params(_args(fam, n=1288, scale_kind=kg.SCALE_ROWWISE_A | kg.SCALE_ROWWISE_B))


def test_fp8_sass(fp8_builds, fp8_libs):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump here (pip install nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm for CUDA 13)")
    for fam, art in fp8_builds.items():
        proc = subprocess.run([tool, "-sass", str(art.cubin)], capture_output=True, text=True, env=_tool_env(tool))
        if proc.returncode != 0:
            pytest.skip(f"cuobjdump -sass cannot disassemble here: {proc.stderr.strip()[:200]}")
        assert "QGMMA.64x128x32.F32.E4M3.E4M3" in proc.stdout, fam  # fp8 wgmma, fp32 accumulators
        assert "UTMALDG" in proc.stdout and "UTMASTG" in proc.stdout, fam
        # Both accumulators in registers: no more local stores or stack than the 16-bit builds (up to 72 and
        # 72 B over their four kernels; the spilling fp8 builds of 128x256 and 128x128 pingpong: 250-365, 312-352 B).
        assert proc.stdout.count("STL") <= 80, (fam, proc.stdout.count("STL"))
        res = subprocess.run([tool, "-res-usage", str(art.cubin)], capture_output=True, text=True,
                             env=_tool_env(tool))
        stacks = [int(s) for s in re.findall(r"STACK:(\d+)", res.stdout)]
        assert stacks and max(stacks) <= 96, (fam, stacks)
        elf = subprocess.run([tool, "-elf", str(art.cubin)], capture_output=True, text=True, env=_tool_env(tool))
        sizes = re.findall(r"EIATTR_KPARAM_INFO.*?Ordinal\s*:\s*0x0.*?Size\s*:\s*0x([0-9a-f]+)", elf.stdout, re.S)
        if sizes:
            assert int(sizes[0], 16) == kg.GemmHost(fp8_libs[fam], fam, "e4m3", "nk").params_size


@pytest.mark.skipif(os.environ.get("FLUX_SHMEM_TEST_FP8_FAST_ACCUM") != "1",
                    reason="builds the FP8FastAccum variant too (another minute per family): set "
                           "FLUX_SHMEM_TEST_FP8_FAST_ACCUM=1")
def test_fast_accum_build(monkeypatch):
    monkeypatch.setenv(kb.ENV_FP8_FAST_ACCUM, "1")
    art = kb.build("gemm_rs", "90a", fp8=True)
    h = kg.GemmHost(ctypes.CDLL(str(art.host_lib)), "gemm_rs", "e4m3", "nk")
    assert h.fast_accum and h.fp8


def test_fp8_benchmark_cli():
    from benchmarks import gemm_fp8
    a = gemm_fp8.parse_args(["--shapes", "8192x1280x8192,128x128x128", "--scales", "rowwise"])
    assert a.shape_list == [(8192, 1280, 8192), (128, 128, 128)] and a.scale_list == ["rowwise"]
    with pytest.raises(SystemExit):
        gemm_fp8.parse_args(["--scales", "blockwise"])
    if not torch.cuda.is_available():
        assert gemm_fp8.main(["--shapes", "128x128x128"]) == 3


def test_tuner_takes_e4m3(monkeypatch, tmp_path):
    """The tuner measures e4m3 too (against torch._scaled_mm, on a GPU): its candidates are the configurations the
    fp8 builds run from registers, its cache entries are keyed apart for the FP8FastAccum builds, and without a
    GPU it says so."""
    from flux_shmem.kernels import tune, tune_cache
    from flux_shmem import tune as cli
    monkeypatch.delenv(kb.ENV_FP8_FAST_ACCUM, raising=False)
    for m, n, k in ((8192, 1280, 8192), (1024, 768, 4096)):
        cands = tune.tune_candidates(m, n, k, 132, dtype="e4m3")
        assert cands and {c.config for c in cands} <= set(registry.names_for("e4m3"))
        assert cands[0] == config.heuristic(m, n, k, "e4m3", "nk", 132)
    assert registry.tuning_dtype("e4m3") == "e4m3" and registry.tuning_dtype("bf16") == "bf16"
    monkeypatch.setenv(kb.ENV_FP8_FAST_ACCUM, "1")
    assert registry.tuning_dtype("e4m3") == "e4m3fast" and registry.tuning_dtype("bf16") == "bf16"
    assert {c.config for c in tune.tune_candidates(8192, 1280, 8192, 132, dtype="e4m3")} - \
        set(registry.names_for("e4m3")) == set()
    assert tune_cache._KEY_RE.match("NVIDIA H100|sm132|cuda13.0|e4m3fast|nk|8192x1280x8192")
    with pytest.raises(FluxShmemError, match="'nk'"):
        tune.tune_shape(1024, 1024, 1024, "e4m3", "kn", 132, write=False)
    with pytest.raises(SystemExit):
        cli.main(["--dtype", "e4m3", "--layouts", "kn", "--shapes", "1024x1024x1024"])
    if not torch.cuda.is_available():
        with pytest.raises(FluxShmemError, match="CUDA device"):
            tune.tune_shape(1024, 1024, 1024, "e4m3", "nk", 132, write=False)


def test_mixed_scale_kinds_gather_alike():
    """Issue 37: PEs passing AllGatherGEMM different scale kinds (per-tensor on one, rowwise on another) once ran the
    scale all-gather with different sizes (wrong scales, a peer's slot overwritten). Every PE now sends one scale per
    shard row whatever its kind: the gathered sizes agree and each gathered row gets its own shard's scale."""
    from types import SimpleNamespace
    from flux_shmem.ops.ag_gemm import AllGatherGEMM
    W, ms = 3, 10
    kinds = [torch.tensor(0.5), torch.rand(ms) + 0.1, torch.rand(ms, 1) + 0.1]   # per-tensor, rowwise, rowwise [ms, 1]
    sent = {}

    def on_pe(pe):
        def scale_ag(packed, copy=True):  # the all-gather as PE `pe` sees it: every PE's packed rows, PE order
            sent[pe] = packed.clone()
            return torch.cat([sent.get(q, packed) for q in range(W)])
        return SimpleNamespace(rt=SimpleNamespace(world_size=W), scale_ag=scale_ag)
    for pe in range(W):  # each PE sends (the size must not depend on its kind)
        AllGatherGEMM.gather_scales(on_pe(pe), kinds[pe], ms)
    assert len({tuple(t.shape) for t in sent.values()}) == 1        # one size on every PE
    got = AllGatherGEMM.gather_scales(on_pe(0), kinds[0], ms)
    want = torch.cat([kinds[0].expand(ms), kinds[1], kinds[2].reshape(-1)])
    assert got.shape == (W * ms,) and torch.equal(got, want)
