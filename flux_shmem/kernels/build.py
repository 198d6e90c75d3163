"""Compile `csrc/<family>.cu` into cubins with nvcc, device-linked against NVSHMEM's `libnvshmem_device.a`.

Each family is compiled in up to two passes from the same source (run at the same time):
  * device pass (`-DFS_DEVICE_PASS`; for families calling NVSHMEM `-rdc=true`, then `nvcc -dlink -cubin` with the
    NVSHMEM device library): the cubin that `flux_shmem.kernels.module` loads;
  * host pass (`-DFS_HOST_PASS`, `-shared`), only for sources that mention FS_HOST_PASS: a small shared library
    whose C functions fill CUTLASS kernel parameter blocks (TMA descriptors are made on the host).

The GEMM families (sources that include flux_shmem/gemm_ext.cuh) are built once per kernel configuration of the
registry (flux_shmem/kernels/registry.py): the configuration's FS_GEMM_* macros are -D flags. Their fp8 build
(`fp8=True`: -DFS_GEMM_FP8=1, the e4m3 kernels with K-tile 128 instead of the 16-bit ones) is a build of its own,
keyed apart; FLUX_SHMEM_FP8_FAST_ACCUM=1 makes it with CUTLASS's FP8FastAccum schedules (another key).

Artifacts are cached on disk under a key made of the sources' hash, the arch, the build flags (configuration
included), the CUTLASS version and, for families linked with NVSHMEM, the NVSHMEM version, so a different NVSHMEM
never loads a cubin linked against another one (and GEMM cubins, which do not link it, stay valid across NVSHMEM
versions).
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import BuildError, FluxShmemError
from . import registry
from .registry import ENV_FP8_FAST_ACCUM, fp8_fast_accum  # noqa: F401  (re-exported: benchmarks, tests)

DEFAULT_ARCHS = ("90a",)
_CXX_FLAGS = ("-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler=-fno-strict-aliasing", "-DNDEBUG")


def csrc_dir() -> Path:
    """The kernel sources: `$FLUX_SHMEM_CSRC`, else `csrc/` beside the package (editable install / checkout)."""
    env = os.environ.get("FLUX_SHMEM_CSRC")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "csrc"
    if not (path / "include").is_dir():
        raise BuildError(f"kernel sources not found at {path}: install flux_shmem from a checkout "
                         "(`pip install -e .`) or set FLUX_SHMEM_CSRC to the repository's csrc/ folder")
    return path


def families() -> list[str]:
    """Every operator family, one per `csrc/*.cu`."""
    return sorted(p.stem for p in csrc_dir().glob("*.cu"))


def cache_dir() -> Path:
    return Path(os.environ.get("FLUX_SHMEM_CACHE", Path.home() / ".cache" / "flux_shmem"))


def archs_from_env() -> tuple[str, ...]:
    """`FLUX_SHMEM_ARCHS=90a,90` overrides the arch list (compute capability digits, optional `a` suffix)."""
    raw = os.environ.get("FLUX_SHMEM_ARCHS")
    if not raw:
        return DEFAULT_ARCHS
    archs = tuple(a.strip() for a in raw.split(",") if a.strip())
    for a in archs:
        if not re.fullmatch(r"\d{2,3}a?", a):
            raise BuildError(f"FLUX_SHMEM_ARCHS entry {a!r} is not an arch like '90a' or '90'")
    return archs


def _package_root(dist_module: str) -> Path | None:
    spec = importlib.util.find_spec(dist_module)  # finds without importing (cutlass_library imports heavy deps)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@dataclasses.dataclass(frozen=True)
class Toolchain:
    nvshmem_root: Path | None
    nvshmem_version: str
    cutlass_includes: tuple[Path, ...]
    cutlass_version: str

    @property
    def nvshmem_device_lib(self) -> Path:
        assert self.nvshmem_root is not None
        return self.nvshmem_root / "lib" / "libnvshmem_device.a"

    def includes(self) -> list[str]:
        inc = [f"-I{csrc_dir() / 'include'}"]
        if self.nvshmem_root is not None:
            inc.append(f"-I{self.nvshmem_root / 'include'}")
        inc += [f"-I{p}" for p in self.cutlass_includes]
        return inc


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    nv_root = None
    try:
        nv_root = _package_root("nvidia.nvshmem")
    except ModuleNotFoundError:
        pass
    cut_root = _package_root("cutlass_library")
    cut_inc: tuple[Path, ...] = ()
    if cut_root is not None:
        cut_inc = (cut_root / "source" / "include", cut_root / "source" / "tools" / "util" / "include")
    return Toolchain(nv_root, _version("nvidia-nvshmem-cu13"), cut_inc, _version("nvidia-cutlass"))


def nvcc_path() -> str:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc is None:
        for cand in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(cand):
                nvcc = cand
    if nvcc is None:
        raise BuildError("nvcc not found: install the CUDA toolkit (12.4+; 13.0 tested), put nvcc on PATH or "
                         "set NVCC=/path/to/nvcc; or copy prebuilt kernels into FLUX_SHMEM_CACHE")
    return nvcc


def _main_source(family: str) -> Path:
    main = csrc_dir() / f"{family}.cu"
    if not main.exists():
        raise BuildError(f"no kernel family {family!r}: expected {main}; families are {families()}")
    return main


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"(flux_shmem/[^"]+)"', re.M)


def _sources(family: str) -> list[Path]:
    """The family's source and the project headers it includes, transitively: an edit to a header only the comm
    kernels use must not rebuild every GEMM configuration (minutes each)."""
    inc = csrc_dir() / "include"
    main = _main_source(family)
    seen: dict[Path, None] = {}
    todo = [main]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen[p] = None
        for name in _LOCAL_INCLUDE.findall(p.read_text()):
            h = inc / name
            if not h.is_file():
                raise BuildError(f"{p.name} includes \"{name}\", which is not under {inc}")
            todo.append(h)
    return [main] + sorted(q for q in seen if q != main)


def needs_host_lib(family: str) -> bool:
    return "FS_HOST_PASS" in _main_source(family).read_text()


def uses_nvshmem(family: str) -> bool:
    """Families calling NVSHMEM device APIs are device-linked with it and need `library_init` after loading."""
    return "<nvshmem.h>" in _main_source(family).read_text()


def is_gemm_family(family: str) -> bool:
    """Families built per kernel configuration of the registry: their source includes the CUTLASS extensions."""
    return "flux_shmem/gemm_ext.cuh" in _main_source(family).read_text()


def gemm_families() -> list[str]:
    return [f for f in families() if is_gemm_family(f)]


def resolve_config(family: str, config: "str | registry.KernelConfig | None") -> "registry.KernelConfig | None":
    """The registry entry a build of `family` uses (the default one when None), or None for non-GEMM families."""
    if not is_gemm_family(family):
        if config is not None:
            raise BuildError(f"family {family!r} has no kernel configurations (only {gemm_families()} do); "
                             f"got config={config!r}")
        return None
    try:
        return registry.get(config)
    except FluxShmemError as e:  # an unknown name: a build error like the others
        raise BuildError(str(e)) from None


def fp8_defines(fp8: bool) -> tuple[str, ...]:
    """The fp8 build's macros (without the -D): csrc/include/flux_shmem/gemm_config.cuh FS_GEMM_FP8, _TILE_K and
    _FP8_FAST_ACCUM."""
    if not fp8:
        return ()
    return ("FS_GEMM_FP8=1", f"FS_GEMM_TILE_K={registry.TILE_K_FP8}", f"FS_GEMM_FP8_FAST_ACCUM={int(fp8_fast_accum())}")


def _flags(cfg: "registry.KernelConfig | None", fp8: bool = False) -> tuple[str, ...]:
    return _CXX_FLAGS + (tuple(f"-D{d}" for d in cfg.defines + fp8_defines(fp8)) if cfg is not None else ())


def _check_fp8(family: str, fp8: bool) -> None:
    if fp8 and not is_gemm_family(family):
        raise BuildError(f"family {family!r} has no fp8 build (only {gemm_families()} do)")


def cache_key(family: str, arch: str, config: "str | registry.KernelConfig | None" = None, *,
              fp8: bool = False) -> str:
    tc = toolchain()
    cfg = resolve_config(family, config)
    _check_fp8(family, fp8)
    h = hashlib.sha256()
    for p in _sources(family):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(_flags(cfg, fp8)).encode())
    name = family if cfg is None else f"{family}-{cfg.name}"
    if fp8:
        name += "-e4m3" + ("-fastacc" if fp8_fast_accum() else "")
    nvshmem = f"-nvshmem{tc.nvshmem_version}" if uses_nvshmem(family) else ""
    # Only the GEMM families include CUTLASS: the others' keys do not name it (their cubins load where it is absent)
    cutlass = f"-cutlass{tc.cutlass_version}" if cfg is not None else ""
    return f"{name}-sm{arch}{nvshmem}{cutlass}-{h.hexdigest()[:16]}"


@dataclasses.dataclass(frozen=True)
class Artifacts:
    family: str
    arch: str
    cubin: Path
    host_lib: Path | None
    config: str | None = None  # registry entry of a GEMM family's build
    fp8: bool = False          # the fp8 build (e4m3 kernels)


def _gencode(arch: str) -> str:
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def _run_all(steps: list[list[tuple[list[str], str]]]) -> None:
    """Run several sequences of commands at once (each sequence in order); raise one error listing the failures."""
    procs = []
    for seq in steps:
        procs.append(subprocess.Popen(["/bin/sh", "-c", " && ".join(_sh(c) for c, _ in seq)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failures = []
    for seq, proc in zip(steps, procs):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            what = " / ".join(w for _, w in seq)
            cmds = "\n".join("$ " + " ".join(c) for c, _ in seq)
            failures.append(f"{what} failed (exit {proc.returncode}):\n{cmds}\n{out}")
    if failures:
        raise BuildError("\n".join(failures))


def _sh(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def _artifact_paths(family: str, arch: str, config=None, fp8: bool = False) -> tuple[Path, Path]:
    key = cache_key(family, arch, config, fp8=fp8)
    return cache_dir() / f"{key}.cubin", cache_dir() / f"lib{key}.so"


def cached(family: str, arch: str, config: "str | registry.KernelConfig | None" = None, *,
           fp8: bool = False) -> Artifacts | None:
    """The cached artifacts for this family, arch (and GEMM configuration and fp8 build), or None when they must be
    built."""
    cfg = resolve_config(family, config)
    cubin, lib = _artifact_paths(family, arch, cfg, fp8)
    host = needs_host_lib(family)
    if cubin.exists() and (not host or lib.exists()):
        return Artifacts(family, arch, cubin, lib if host else None, cfg.name if cfg else None, fp8)
    return None


def build(family: str, arch: str = DEFAULT_ARCHS[0], *, config: "str | registry.KernelConfig | None" = None,
          fp8: bool = False, force: bool = False, verbose: bool = False) -> Artifacts:
    """Build (or reuse from the cache) the cubin and host library of one family for one arch; GEMM families are
    built per kernel configuration (`config`: a registry name; None = the default), and with `fp8` as their fp8
    build (the e4m3 kernels) instead of the 16-bit one."""
    cfg = resolve_config(family, config)
    _check_fp8(family, fp8)
    if not force and (hit := cached(family, arch, cfg, fp8=fp8)) is not None:
        return hit
    tc = toolchain()
    if tc.nvshmem_root is None or not tc.nvshmem_device_lib.exists():
        raise BuildError("NVSHMEM device library not found: `pip install nvidia-nvshmem-cu13` "
                         "(headers and libnvshmem_device.a come from that wheel)")
    nvcc = nvcc_path()
    cubin, lib = _artifact_paths(family, arch, cfg, fp8)
    cubin.parent.mkdir(parents=True, exist_ok=True)
    src = csrc_dir() / f"{family}.cu"
    what = family if cfg is None else f"{family} [{cfg.name}{', fp8' if fp8 else ''}]"
    # One builder per artifact across processes: several ranks of one node may start at once.
    with open(f"{cubin}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (hit := cached(family, arch, cfg, fp8=fp8)) is not None:
            return hit
        with tempfile.TemporaryDirectory(dir=cubin.parent) as tmp:
            obj = Path(tmp) / f"{family}.o"
            common = [nvcc, _gencode(arch), *_flags(cfg, fp8), *tc.includes()]
            tmp_cubin = Path(tmp) / "out.cubin"
            if uses_nvshmem(family):
                device = [(common + ["-rdc=true", "-DFS_DEVICE_PASS", "-c", str(src), "-o", str(obj)],
                           f"nvcc device pass of {what}"),
                          ([nvcc, _gencode(arch), "-dlink", "-cubin", str(obj), str(tc.nvshmem_device_lib),
                            "-o", str(tmp_cubin)], f"nvcc device link of {what} with libnvshmem_device.a")]
            else:  # plain whole-program cubin: no relocatable code, better codegen
                device = [(common + ["-DFS_DEVICE_PASS", "-cubin", str(src), "-o", str(tmp_cubin)],
                           f"nvcc device pass of {what}")]
            steps = [device]
            host = needs_host_lib(family)
            tmp_lib = Path(tmp) / "out.so"
            if host:
                steps.append([(common + ["-DFS_HOST_PASS", "-shared", "-Xcompiler=-fPIC", str(src), "-o",
                                         str(tmp_lib)], f"nvcc host pass of {what}")])
            _run_all(steps)
            if host:
                os.replace(tmp_lib, lib)
            meta = {"family": family, "arch": arch, "config": cfg.name if cfg else None,
                    "nvshmem": tc.nvshmem_version if uses_nvshmem(family) else None, "cutlass": tc.cutlass_version,
                    "defines": list(cfg.defines + fp8_defines(fp8)) if cfg else [], "fp8": fp8,
                    "nvcc": subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
                    .splitlines()[-1]}
            Path(f"{cubin}.json").write_text(json.dumps(meta, indent=1))
            os.replace(tmp_cubin, cubin)
    if verbose:
        print(f"built {cubin}")
    return Artifacts(family, arch, cubin, lib if needs_host_lib(family) else None, cfg.name if cfg else None, fp8)
