"""CUTLASS GEMM families (ag_gemm, gemm_rs) on the CPU: they compile (cubin + host library), the host library loads
without a GPU and exports every function, the ctypes mirrors match the C ABI field by field, the cubins hold wgmma
(HGMMA) code, argument errors are reported, and the tile -> all-gather chunk arithmetic matches a Python reference.
"""
from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from flux_shmem.errors import BuildError, FluxShmemError
from flux_shmem.kernels import build as kb
from flux_shmem.kernels import config
from flux_shmem.kernels import gemm as kg
from flux_shmem.kernels import registry

FAMILIES = ("ag_gemm", "gemm_rs")
KERNELS = {fam: [f"fs_{fam}_{dt}_{bl}" for dt in ("bf16", "fp16") for bl in ("kn", "nk")] for fam in FAMILIES}
COMMON_SYMBOLS = ("fs_gemm_last_error", "fs_gemm_tile_m", "fs_gemm_tile_n", "fs_gemm_cluster_m",
                  "fs_gemm_cluster_n", "fs_gemm_pingpong", "fs_abi_sizeof", "fs_abi_offsetof")
ROOT = Path(__file__).resolve().parents[1]

# Building both families from scratch takes several minutes on a 2-core machine.
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def artifacts():
    """Both families built once for this module (a cache hit when already built in this session's cache)."""
    return {fam: kb.build(fam, "90a") for fam in FAMILIES}


@pytest.fixture(scope="module")
def libs(artifacts):
    return {fam: ctypes.CDLL(str(art.host_lib)) for fam, art in artifacts.items()}


def _cuobjdump() -> str | None:
    """A cuobjdump that can disassemble (it needs nvdisasm beside it or on PATH), or None."""
    cands = [shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    purelib = Path(sysconfig.get_paths()["purelib"])
    cands += [str(p) for p in purelib.glob("nvidia/cu*/bin/cuobjdump")]
    for c in cands:
        if c and os.path.exists(c):
            return c
    return None


def _tool_env(tool: str) -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(tool).parent) + os.pathsep + env.get("PATH", "")
    return env


def test_cubins_and_host_libs_built(artifacts):
    for fam, art in artifacts.items():
        data = art.cubin.read_bytes()
        assert data[:4] == b"\x7fELF", fam
        for name in KERNELS[fam]:
            assert name.encode() in data, (fam, name)
        assert art.host_lib is not None and art.host_lib.exists(), fam
        assert not kb.uses_nvshmem(fam)  # GEMM kernels only use plain loads/stores on signal words


def test_host_lib_loads_and_exports(libs, artifacts):
    for fam, lib in libs.items():
        for name in KERNELS[fam]:
            assert hasattr(lib, name + "_params"), name
            assert hasattr(lib, name + "_params_size"), name
            assert hasattr(lib, name + "_workspace_size"), name
        for sym in COMMON_SYMBOLS:
            assert hasattr(lib, sym), (fam, sym)
        # No dynamic CUDA dependency: the library loads on machines without a driver or toolkit.
        ldd = shutil.which("ldd")
        if ldd:
            out = subprocess.run([ldd, str(artifacts[fam].host_lib)], capture_output=True, text=True).stdout
            assert "libcuda" not in out and "libcudart" not in out, out


def test_abi_mirrors_match(libs):
    for lib in libs.values():
        kg.check_abi(lib)  # raises on any size or offset mismatch
        for name, st in kg.ABI_STRUCTS.items():
            assert lib.fs_abi_sizeof(name.encode()) == ctypes.sizeof(st)
    assert ctypes.sizeof(kg.FsLaunch) == 40
    assert ctypes.sizeof(kg.FsCtx) == 32
    assert ctypes.sizeof(kg.FsAgGemmArgs) == 192 and ctypes.sizeof(kg.FsGemmRsArgs) == 176
    # fields added later sit at the end of both structs: split-K (issue 11), then fp8 scales (issue 26)
    for st in (kg.FsAgGemmArgs, kg.FsGemmRsArgs):
        assert [f for f, _ in st._fields_[-8:]] == ["splits", "tail_chunks", "workspace", "workspace_bytes", "scale_a",
                                                    "scale_b", "scale_kind", "pad2_"]
    assert kg.FsAgGemmArgs.splits.offset == 144 and kg.FsGemmRsArgs.splits.offset == 128


def test_tile_shape_and_param_sizes(libs, monkeypatch):
    monkeypatch.delenv("FLUX_SHMEM_GEMM_SWIZZLE", raising=False)
    for fam, lib in libs.items():
        sizes = set()
        for dt in ("bf16", "fp16"):
            for bl in ("kn", "nk"):
                h = kg.GemmHost(lib, fam, dt, bl)
                assert h.config.name == registry.DEFAULT and not h.pingpong
                assert h.tile_shape == (128, 256)
                assert h.cluster_shape in ((1, 1), (2, 1), (1, 2))
                assert 0 < h.params_size <= 4096  # fits the classic 4 KB kernel parameter limit
                assert h.tiles(1000, 4096) == (8, 16)
                assert h.swizzle(8192) == 8 and h.swizzle(8192, group_m_tiles=8) == 4
                sizes.add(h.params_size)
        assert len(sizes) >= 1


def test_param_sizes_match_cubin(artifacts, libs):
    """Each kernel's single parameter, as declared in the cubin, is exactly the host library's params_size."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump here (pip install nvidia-cuda-cuobjdump for CUDA 13)")
    for fam, art in artifacts.items():
        proc = subprocess.run([tool, "-elf", str(art.cubin)], capture_output=True, text=True, env=_tool_env(tool))
        if proc.returncode != 0:
            pytest.skip(f"cuobjdump -elf failed: {proc.stderr.strip()[:200]}")
        # Each `.nv.info.<kernel>` block lists EIATTR_KPARAM_INFO per parameter: "Ordinal : 0x0 ... Size : 0x700".
        blocks = re.split(r"\n(?=\.nv\.info\.\w+\s*\n)", proc.stdout)
        found = {}
        for blk in blocks:
            m = re.match(r"\.nv\.info\.(\w+)\s*\n", blk)
            if not m or m.group(1) not in KERNELS[fam]:
                continue
            sizes = re.findall(r"EIATTR_KPARAM_INFO.*?Ordinal\s*:\s*0x([0-9a-f]+).*?Size\s*:\s*0x([0-9a-f]+)", blk,
                               re.S)
            assert len(sizes) == 1, (m.group(1), sizes)  # exactly one by-value parameter
            found[m.group(1)] = int(sizes[0][1], 16)
        if not found:
            pytest.skip("could not read EIATTR_KPARAM_INFO from cuobjdump -elf output")
        assert set(found) == set(KERNELS[fam]), found
        for name, size in found.items():
            dt, bl = name.split("_")[-2:]
            assert size == kg.GemmHost(libs[fam], fam, dt, bl).params_size, (name, size)


def test_hgmma_in_sass(artifacts):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump here (pip install nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm for CUDA 13)")
    for fam, art in artifacts.items():
        proc = subprocess.run([tool, "-sass", str(art.cubin)], capture_output=True, text=True, env=_tool_env(tool))
        if proc.returncode != 0:
            pytest.skip(f"cuobjdump -sass cannot disassemble here: {proc.stderr.strip()[:200]}")
        funcs = re.split(r"\n\s*Function : ", proc.stdout)
        seen = {}
        for f in funcs[1:]:
            name = f.split()[0]
            seen[name] = f
        for name in KERNELS[fam]:
            assert name in seen, (name, list(seen))
            body = seen[name]
            assert "HGMMA.64x256x16.F32" in body, name
            assert "UTMALDG" in body and "UTMASTG" in body, name  # TMA loads and stores
        if fam == "gemm_rs":
            for name in KERNELS[fam]:
                # the tile mark: one system fence, then a plain 64-bit system-scope store of the epoch
                assert re.search(r"MEMBAR\.SC\.SYS.*\n(?:.*\n){0,12}?.*STG\.E\.64\.STRONG\.SYS", seen[name]), name


def _ag_args(**kw) -> kg.FsAgGemmArgs:
    base = dict(m=8192, n=8192, k=8192, a=0x10000, b=0x20000, d=0x30000, bias=None, sm_count=132, device_id=0,
                chunk_flags=0x40000, epoch=0x50000, rows_per_shard=1024, chunk_rows=256, chunks_per_shard=4, wait=1)
    base.update(kw)
    return kg.FsAgGemmArgs(**base)


def test_params_errors_are_reported(libs):
    ag = kg.GemmHost(libs["ag_gemm"], "ag_gemm", "bf16", "nk")
    with pytest.raises(FluxShmemError, match="bad problem size"):
        ag.params(_ag_args(m=0))
    with pytest.raises(FluxShmemError, match="16-byte aligned"):
        ag.params(_ag_args(a=0x10002))
    with pytest.raises(FluxShmemError, match="multiples of 8"):
        ag.params(_ag_args(k=8190))
    with pytest.raises(FluxShmemError, match="sm_count"):
        ag.params(_ag_args(sm_count=0))
    with pytest.raises(FluxShmemError, match="inconsistent chunking"):
        ag.params(_ag_args(chunks_per_shard=3))
    with pytest.raises(FluxShmemError, match="chunk_flags and epoch"):
        ag.params(_ag_args(chunk_flags=None))
    with pytest.raises(FluxShmemError, match="swizzle must be 1, 2, 4 or 8"):
        ag.params(_ag_args(swizzle=3))
    with pytest.raises(FluxShmemError, match="takes FsAgGemmArgs"):
        ag.params(kg.FsGemmRsArgs())
    with pytest.raises(FluxShmemError, match="scale_a, scale_b and scale_kind are for the e4m3 kernels"):
        ag.params(_ag_args(scale_a=0x60000))
    rs = kg.GemmHost(libs["gemm_rs"], "gemm_rs", "fp16", "kn")
    with pytest.raises(FluxShmemError, match="tile_ready needs epoch"):
        rs.params(kg.FsGemmRsArgs(m=256, n=256, k=256, a=0x10000, b=0x20000, d=0x30000, sm_count=132,
                                  tile_ready=0x40000, epoch=None))


def test_split_k_workspace_and_errors(libs):
    """8192x1280x8192 on 132 SMs: 160 cluster tiles of 128x256 on 66 clusters; with splits=2 the last 94 tiles run
    as stream-K over the 66 clusters, and each cluster's range (2 CTA tiles) has a reduction slot of fp32 partials,
    after a lock region of fixed size that every shape shares; whole waves need nothing. Below one wave (M = 1024,
    20 cluster tiles) splits=3 makes 60 ranges."""
    lock_region = 64 * 1024
    for fam in FAMILIES:
        h = kg.GemmHost(libs[fam], fam, "bf16", "nk")
        args = kg.ARGS_TYPE[fam]
        base = dict(m=8192, n=1280, k=8192, a=0x10000, b=0x20000, d=0x30000, sm_count=132)
        assert h.workspace_size(args(**base)) == 0
        assert h.workspace_size(args(**base, splits=1)) == 0
        assert h.workspace_size(args(**base, splits=2)) == lock_region + 66 * 2 * 128 * 256 * 4
        assert h.workspace_size(args(**{**base, "m": 1024}, splits=3)) == lock_region + 60 * 2 * 128 * 256 * 4
        assert h.workspace_size(args(**{**base, "m": 16384}, splits=2)) == lock_region + 66 * 2 * 128 * 256 * 4
        assert h.workspace_size(args(**{**base, "m": 66 * 256, "n": 256}, splits=2)) == 0  # one whole wave
        assert config.tail_plan(160, 66, 2, 128) == (66, 66) and config.tail_plan(20, 66, 3, 128) == (0, 60)
        with pytest.raises(FluxShmemError, match="splits=17 but this kernel configuration takes 1 to 16"):
            h.workspace_size(args(**base, splits=17))
        with pytest.raises(FluxShmemError, match="splits=4 exceeds the 2 K-tiles of k=128"):
            h.workspace_size(args(**{**base, "k": 128}, splits=4))
        with pytest.raises(FluxShmemError, match="needs a zeroed, 16-byte aligned workspace of"):
            h.params(args(**base, splits=2))
        with pytest.raises(FluxShmemError, match="needs a zeroed, 16-byte aligned workspace of"):
            h.params(args(**base, splits=2, workspace=0x40000, workspace_bytes=1024))


def test_params_without_driver_is_a_clear_error(libs):
    """Valid arguments get as far as the TMA descriptors, which need the NVIDIA driver."""
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("an NVIDIA driver is present: descriptors would be made (covered by the GPU tests)")
    except OSError:
        pass
    ag = kg.GemmHost(libs["ag_gemm"], "ag_gemm", "bf16", "kn")
    with pytest.raises(FluxShmemError, match="libcuda"):
        ag.params(_ag_args())


# --- tile -> chunk arithmetic (csrc/include/flux_shmem/tile_schedule.cuh) ------------------------------------------

_SPAN_MAIN = r"""
#include <cstdio>
#include "flux_shmem/tile_schedule.cuh"
int main() {
  long long M; int Ms, cr, tm, cps;
  while (std::scanf("%lld %d %d %d %d", &M, &Ms, &cr, &tm, &cps) == 5) {
    int tiles = fs::tiles_along(M, tm);
    std::printf("%d\n", tiles);
    for (int t = 0; t < tiles; ++t) {
      fs::ChunkSpan sp = fs::chunk_span_for_tile(t, tm, M, Ms, cr);
      int n = fs::chunk_span_count(sp, cps);
      std::printf("%d", n);
      for (int i = 0; i < n; ++i) std::printf(" %d", fs::chunk_span_flag(sp, cps, i));
      std::printf("\n");
    }
  }
  return 0;
}
"""


def _reference(M: int, Ms: int, cr: int, tm: int) -> list[list[int]]:
    """Brute force: flags of every chunk whose rows intersect each tile's rows below M."""
    cps = -(-Ms // cr)
    shards = -(-M // Ms)
    chunks = []
    for s in range(shards):
        for c in range(cps):
            lo, hi = s * Ms + c * cr, s * Ms + min((c + 1) * cr, Ms)
            chunks.append((s * cps + c, lo, hi))
    out = []
    for t in range(-(-M // tm)):
        r0, r1 = t * tm, min((t + 1) * tm, M)
        out.append(sorted(f for f, lo, hi in chunks if lo < r1 and r0 < hi))
    return out


def test_tile_chunk_span_matches_reference(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    cmd = [cxx, "-std=c++17", "-O1", "-x", "c++"] if cxx else None
    if cmd is None:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            pytest.skip("no C++ compiler (g++ or nvcc)")
        cmd = [nvcc, "-std=c++17", "-x", "c++"]
    src = tmp_path / "span.cpp"
    src.write_text(_SPAN_MAIN)
    exe = tmp_path / "span"
    subprocess.run(cmd + [f"-I{ROOT / 'csrc' / 'include'}", str(src), "-o", str(exe)], check=True)

    rng = random.Random(1234)
    cases = [(8192, 1024, 256, 128), (8192, 1024, 1024, 128), (1000, 250, 64, 128), (1, 1, 1, 128),
             (8192, 8192, 8192, 128), (384, 100, 7, 128), (16384, 2048, 192, 128), (130, 65, 13, 128)]
    for _ in range(400):
        tm = rng.choice([64, 128, 256])
        Ms = rng.randint(1, 3000)
        cr = rng.randint(1, Ms + 50)
        shards = rng.randint(1, 8)
        M = Ms * shards - (rng.randint(0, Ms - 1) if rng.random() < 0.3 else 0)  # sometimes fewer rows than shards
        cases.append((M, Ms, cr, tm))
    stdin = "".join(f"{M} {Ms} {cr} {tm} {-(-Ms // cr)}\n" for M, Ms, cr, tm in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split("\n")
    pos = 0
    for M, Ms, cr, tm in cases:
        tiles = int(out[pos]); pos += 1
        ref = _reference(M, Ms, cr, tm)
        assert tiles == len(ref), (M, Ms, cr, tm)
        for t in range(tiles):
            got = [int(x) for x in out[pos].split()[1:]]; pos += 1
            assert got == ref[t], (M, Ms, cr, tm, t, got, ref[t])


# --- the pingpong schedule: its own code path through the kernel and the scheduler, compiled in CI -----------------

PINGPONG = "128x128_c2x1_pp"


@pytest.fixture(scope="module")
def pingpong_lib():
    art = kb.build("gemm_rs", "90a", config=PINGPONG)
    return art, ctypes.CDLL(str(art.host_lib))


def test_pingpong_config_builds(pingpong_lib):
    art, lib = pingpong_lib
    kg.check_abi(lib)
    h = kg.GemmHost(lib, "gemm_rs", "bf16", "nk", config=PINGPONG)
    assert h.pingpong and h.tile_shape == (128, 128) and h.cluster_shape == (2, 1)
    base = dict(m=8192, n=1280, k=8192, a=0x10000, b=0x20000, d=0x30000, sm_count=132)
    assert h.workspace_size(kg.FsGemmRsArgs(**base)) == 0
    with pytest.raises(FluxShmemError, match="pingpong kernels do not split K"):
        h.params(kg.FsGemmRsArgs(**base, splits=2))
    with pytest.raises(BuildError, match="not as 128x256_c2x1"):
        kg.GemmHost(lib, "gemm_rs", "bf16", "nk", config="128x256_c2x1")
    tool = _cuobjdump()
    if tool is None:
        return
    proc = subprocess.run([tool, "-sass", str(art.cubin)], capture_output=True, text=True, env=_tool_env(tool))
    if proc.returncode == 0:
        assert "HGMMA.64x128x16.F32" in proc.stdout


def test_pdl_only_for_plain_gemms_when_asked(monkeypatch):
    """FLUX_SHMEM_GEMM_PDL=1 gives plain GEMM launches (no chunk waits, no counters) the programmatic-stream-
    serialization attribute; fused GEMMs never get it, nothing does without the variable."""
    pytest.importorskip("cuda.bindings")
    from flux_shmem.kernels import module as km
    plain_ag, plain_rs = kg.FsAgGemmArgs(m=8, n=8, k=8), kg.FsGemmRsArgs(m=8, n=8, k=8)
    fused_ag, fused_rs = kg.FsAgGemmArgs(m=8, n=8, k=8, wait=1), kg.FsGemmRsArgs(m=8, n=8, k=8, tile_ready=0x1000)
    monkeypatch.delenv(kg.ENV_PDL, raising=False)
    assert not any(kg.uses_pdl(a) for a in (plain_ag, plain_rs, fused_ag, fused_rs))
    monkeypatch.setenv(kg.ENV_PDL, "1")
    assert [kg.uses_pdl(a) for a in (plain_ag, plain_rs, fused_ag, fused_rs)] == [True, True, False, False]
    k = object.__new__(km.Kernel)
    k._configs = {}
    d = km._driver()
    ids = lambda cfg: [a.id for a in cfg.attrs]  # noqa: E731
    pdl_id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    with_pdl = k._config((1, 1, 1), (128, 1, 1), 0, 0, (2, 1, 1), None, True)
    without = k._config((1, 1, 1), (128, 1, 1), 0, 0, (2, 1, 1), None, False)
    assert pdl_id in ids(with_pdl) and pdl_id not in ids(without) and with_pdl.numAttrs == 2
