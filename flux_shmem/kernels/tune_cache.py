"""The GEMM tuning cache: measured best (configuration, swizzle, split) per GPU, SM count, CUDA version, dtype,
layout and shape, in one JSON file.

    $FLUX_SHMEM_TUNE_CACHE, default $FLUX_SHMEM_CACHE/gemm_tune.json (~/.cache/flux_shmem/gemm_tune.json)

    {"format": "flux_shmem.gemm_tune", "version": 1, "registry": "<registry fingerprint>",
     "entries": {"NVIDIA H200|sm132|cuda13.0|bf16|nk|8192x1280x8192":
                 {"config": "128x256_c2x1", "swizzle": 8, "split": 2, "ms": 0.271, "heuristic_ms": 0.283,
                  "candidates": 8, "family": "gemm_rs", "measured": "2026-12-03T10:00:00+00:00"}, ...}}

Written by flux_shmem/kernels/tune.py (`python -m flux_shmem.tune`, or FLUX_SHMEM_TUNE=1). A file that is not
valid JSON, has another format or version, or was made for other kernel configurations (the registry's
fingerprint: a configuration name may now mean another kernel) is rejected with a TuneCacheError that names the
file and the fix; the chooser then warns once and uses its heuristic. Writers merge under an exclusive lock
(`<file>.lock`) and replace the file atomically, so concurrent tuners (several ranks of a node) lose nothing and a
reader never sees half a file.
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Dict, Mapping, Optional

from ..errors import FluxShmemError
from . import registry

FORMAT = "flux_shmem.gemm_tune"
VERSION = 1
ENV_PATH = "FLUX_SHMEM_TUNE_CACHE"
_KEY_RE = re.compile(r"^(?P<gpu>[^|]+)\|sm(?P<sm>\d+)\|cuda(?P<cuda>[^|]+)\|(?P<dt>bf16|fp16|e4m3fast|e4m3)\|(?P<lay>kn|nk)\|"
                     r"(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)$")


class TuneCacheError(FluxShmemError):
    """The tuning cache file cannot be used (invalid or stale)."""


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What a measurement depends on besides the problem: GPU model, SMs the GEMM ran on, CUDA version."""

    gpu: str
    sm_count: int
    cuda: str


@dataclasses.dataclass(frozen=True)
class Entry:
    config: str
    swizzle: int
    split: int
    ms: float
    heuristic_ms: Optional[float] = None
    candidates: int = 0
    family: str = ""
    measured: str = ""
    chunks: int = 0  # the stream-K tail's alignment it was measured with (0: ranges at any K-tile; older files)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def default_path() -> Path:
    env = os.environ.get(ENV_PATH)
    if env:
        return Path(env)
    from .build import cache_dir
    return cache_dir() / "gemm_tune.json"


def entry_key(device: DeviceKey, dtype: str, layout: str, m: int, n: int, k: int) -> str:
    if "|" in device.gpu or not device.gpu:
        raise TuneCacheError(f"GPU name {device.gpu!r} cannot be a cache key (empty or contains '|')")
    return f"{device.gpu}|sm{device.sm_count}|cuda{device.cuda}|{dtype}|{layout}|{m}x{n}x{k}"


def current_device(sm_count: int) -> Optional[DeviceKey]:
    """The current CUDA device's key for a GEMM on `sm_count` SMs, or None without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return DeviceKey(torch.cuda.get_device_name(torch.cuda.current_device()), int(sm_count),
                     str(torch.version.cuda))


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _entry(path: Path, key: str, raw) -> Entry:
    def bad(why: str) -> TuneCacheError:
        return TuneCacheError(f"{path}: entry {key!r} {why}: delete the file or re-run `python -m flux_shmem.tune "
                              f"--fresh`")
    if not _KEY_RE.match(key):
        raise bad("is not 'GPU|smN|cudaV|bf16/fp16/e4m3/e4m3fast|kn/nk|MxNxK'")
    if not isinstance(raw, dict):
        raise bad("is not an object")
    fields = {f.name for f in dataclasses.fields(Entry)}
    unknown = set(raw) - fields
    if unknown:
        raise bad(f"has unknown fields {sorted(unknown)}")
    try:
        e = Entry(**raw)
    except TypeError as exc:
        raise bad(f"lacks fields ({exc})") from None
    if e.config not in registry.CONFIGS:
        raise bad(f"names kernel configuration {e.config!r}, which the registry does not have")
    cfg = registry.CONFIGS[e.config]
    if not isinstance(e.swizzle, int) or e.swizzle not in (1, 2, 4, 8):
        raise bad(f"has swizzle {e.swizzle!r} (1, 2, 4 or 8)")
    if not isinstance(e.split, int) or not 1 <= e.split <= cfg.max_splits:
        raise bad(f"has split {e.split!r} ({cfg.name} takes 1 to {cfg.max_splits})")
    if not isinstance(e.chunks, int) or e.chunks < 0:
        raise bad(f"has chunks {e.chunks!r} (an integer >= 0)")
    if not isinstance(e.ms, (int, float)) or not e.ms > 0:
        raise bad(f"has time {e.ms!r} ms (must be > 0)")
    return e


def load(path: Path) -> Dict[str, Entry]:
    """The entries of the cache file at `path` ({} when there is none); TuneCacheError when invalid or stale."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise TuneCacheError(f"{path}: cannot read the GEMM tuning cache ({e})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TuneCacheError(f"{path}: not valid JSON ({e}): delete it or re-run `python -m flux_shmem.tune "
                             f"--fresh`") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TuneCacheError(f"{path}: not a flux_shmem GEMM tuning cache (no \"format\": \"{FORMAT}\"): point "
                             f"{ENV_PATH} elsewhere or delete it")
    if doc.get("version") != VERSION:
        raise TuneCacheError(f"{path}: tuning cache version {doc.get('version')!r}, this flux_shmem reads version "
                             f"{VERSION}: re-run `python -m flux_shmem.tune --fresh` (or delete the file)")
    if doc.get("registry") != registry.fingerprint():
        raise TuneCacheError(f"{path}: stale: measured with kernel configurations {doc.get('registry')!r}, this "
                             f"flux_shmem has {registry.fingerprint()!r} (flux_shmem/kernels/registry.py changed): "
                             f"re-run `python -m flux_shmem.tune --fresh` (or delete the file)")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise TuneCacheError(f"{path}: \"entries\" is not an object: delete the file or re-run "
                             f"`python -m flux_shmem.tune --fresh`")
    return {key: _entry(path, key, raw) for key, raw in entries.items()}


def update(path: Path, new: Mapping[str, Entry], *, fresh: bool = False) -> Dict[str, Entry]:
    """Merge `new` into the cache file (under its lock) and replace it atomically; returns all entries.
    An existing invalid or stale file raises TuneCacheError unless `fresh` (start over)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for key, e in new.items():
        _entry(path, key, e.to_json())  # never write what load() would reject
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = {} if fresh else load(path)
        entries.update(new)
        doc = {"format": FORMAT, "version": VERSION, "registry": registry.fingerprint(),
               "entries": {k: entries[k].to_json() for k in sorted(entries)}}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return entries


class TuneCache:
    """A read view of one cache file, reloaded when the file changes (another process tuned meanwhile)."""

    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path is not None else default_path()
        self._stamp: Optional[tuple] = None
        self._entries: Dict[str, Entry] = {}
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        entries = load(self.path) if stamp is not None else {}
        self._entries, self._stamp = entries, stamp

    def entries(self) -> Dict[str, Entry]:
        with self._lock:
            self._refresh()
            return dict(self._entries)

    def lookup(self, device: DeviceKey, dtype: str, layout: str, m: int, n: int, k: int) -> Optional[Entry]:
        with self._lock:
            self._refresh()
            return self._entries.get(entry_key(device, dtype, layout, m, n, k))


_SHARED: Dict[Path, TuneCache] = {}
_WARNED: set = set()


def shared() -> TuneCache:
    """The process's view of the default cache file (FLUX_SHMEM_TUNE_CACHE is read on every call)."""
    path = default_path()
    if path not in _SHARED:
        _SHARED[path] = TuneCache(path)
    return _SHARED[path]


def snapshot(dtype: str, n: int, k: int) -> Dict[tuple, Entry]:
    """This GPU's measured entries for GEMMs [m, k] x [k, n] of `dtype`, keyed (layout, m, SMs): what
    a fused op takes from PE 0 at construction (config.choose(tuned=)). Empty without a GPU or a usable file."""
    device = current_device(1)
    if device is None:
        return {}
    try:
        entries = shared().entries()
    except TuneCacheError as e:
        warn_once(str(e))
        return {}
    out: Dict[tuple, Entry] = {}
    for key, entry in entries.items():
        g = _KEY_RE.match(key)
        if g and g["gpu"] == device.gpu and g["cuda"] == device.cuda and g["dt"] == dtype and \
                int(g["n"]) == n and int(g["k"]) == k:
            out[(g["lay"], int(g["m"]), int(g["sm"]))] = entry
    return out


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"flux_shmem: GEMM tuning cache ignored, using the heuristic: {message}", stacklevel=3)
