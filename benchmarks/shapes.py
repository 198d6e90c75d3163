"""Shape sets, per-world sharding and validation (pure, no torch).

A problem is given by its *global* GEMM sizes ``M x N x K`` (tensor parallel
over ``world`` ranks):

* ``ag_gemm`` (QKV / up projection): A ``[M, K]`` is row-sharded, each rank
  holds ``[M/world, K]``; B is column-sharded, each rank holds ``[K, N/world]``;
  each rank computes ``[M, N/world]`` = all_gather(A) @ B_local.
* ``gemm_rs`` (down projection): A is column-sharded ``[M, K/world]`` and B
  row-sharded ``[K/world, N]``; each rank ends with ``[M/world, N]`` =
  reduce_scatter(A_local @ B_local).
* ``all_gather``: the communication of ag_gemm alone, ``[M/world, K]`` -> ``[M, K]``.
* ``reduce_scatter``: the communication of gemm_rs alone, ``[M, N]`` -> ``[M/world, N]``.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "OPS",
    "FUSED_OPS",
    "COMM_OPS",
    "DTYPE_BYTES",
    "Layer",
    "LAYERS",
    "DEFAULT_MS",
    "QUICK_MS",
    "Problem",
    "parse_shapes",
    "parse_ops",
    "quick_layers",
    "custom_layers",
    "validate",
    "build_problems",
    "rotation_sets",
    "round_up",
]

FUSED_OPS = ("ag_gemm", "gemm_rs")
COMM_OPS = ("all_gather", "reduce_scatter")
OPS = FUSED_OPS + COMM_OPS
DTYPE_BYTES = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layer:
    """One transformer layer's two tensor-parallel GEMMs (global sizes).

    ``ag_n, ag_k``: N (split over ranks) and K of the AG+GEMM projection.
    ``rs_n, rs_k``: N and K (split over ranks) of the GEMM+RS projection.
    """

    name: str
    ag_n: int
    ag_k: int
    rs_n: int
    rs_k: int


LAYERS = {
    # Llama-3 70B: hidden 8192, ffn 28672.  up/gate-style AG+GEMM and down-projection GEMM+RS.
    "llama3-70b": Layer("llama3-70b", ag_n=28672, ag_k=8192, rs_n=8192, rs_k=28672),
    # GPT-3 175B: hidden 12288, ffn 4*12288.
    "gpt3-175b": Layer("gpt3-175b", ag_n=49152, ag_k=12288, rs_n=12288, rs_k=49152),
}
DEFAULT_MS = (4096, 8192, 16384)
QUICK_MS = (4096, 8192)
QUICK_LOCAL = 4096  # per-GPU N (AG) and K (RS) of the --quick shapes


def round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


def quick_layers(world: int) -> List[Layer]:
    """The --quick layer: per-GPU GEMM is M x 4096 x 4096 whatever the world."""
    d = QUICK_LOCAL
    return [Layer("quick", ag_n=d * world, ag_k=d, rs_n=d, rs_k=d * world)]


def custom_layers(shapes: Sequence[Tuple[int, int, int]]) -> List[Tuple[int, Layer]]:
    """--shapes MxNxK: the same global M, N, K for every op."""
    return [(m, Layer("custom", ag_n=n, ag_k=k, rs_n=n, rs_k=k)) for m, n, k in shapes]


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_shapes(text: str) -> List[Tuple[int, int, int]]:
    """Parse ``"MxNxK,MxNxK,..."`` into a list of (M, N, K); ValueError on bad input."""
    if text is None or not str(text).strip():
        raise ValueError("--shapes needs at least one MxNxK, e.g. 8192x28672x8192")
    out = []
    for part in str(text).split(","):
        if not part.strip():
            raise ValueError(f"empty entry in --shapes {text!r}")
        mt = _SHAPE_RE.match(part)
        if not mt:
            raise ValueError(f"bad shape {part.strip()!r}: expected MxNxK with positive integers, e.g. 8192x28672x8192")
        m, n, k = (int(g) for g in mt.groups())
        if min(m, n, k) <= 0:
            raise ValueError(f"bad shape {part.strip()!r}: M, N and K must be positive")
        out.append((m, n, k))
    return out


def parse_ops(text: str) -> List[str]:
    ops = [o.strip() for o in str(text).split(",") if o.strip()]
    if not ops:
        raise ValueError(f"--ops needs at least one of {','.join(OPS)}")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown op(s) {','.join(bad)}; choose from {','.join(OPS)}")
    seen = []
    for o in ops:
        if o not in seen:
            seen.append(o)
    return seen


@dataclass(frozen=True)
class Problem:
    """One benchmark configuration: an op on global sizes M x N x K over ``world`` ranks."""

    op: str
    label: str
    m: int
    n: int
    k: int
    world: int
    dtype: str = "bf16"

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def m_local(self) -> int:
        return self.m // self.world

    @property
    def n_local(self) -> int:
        return self.n // self.world if self.op == "ag_gemm" else self.n

    @property
    def k_local(self) -> int:
        return self.k // self.world if self.op == "gemm_rs" else self.k

    @property
    def is_fused(self) -> bool:
        return self.op in FUSED_OPS

    @property
    def flops(self) -> int:
        """GEMM FLOPs per GPU (0 for the standalone collectives)."""
        if not self.is_fused:
            return 0
        return 2 * self.m * self.n_local * self.k_local

    @property
    def comm_shape(self) -> Tuple[int, int]:
        """(rows, cols) of the full tensor the collective moves: A [M, K] for AG, C [M, N] for RS."""
        if self.op in ("ag_gemm", "all_gather"):
            return self.m, self.k
        return self.m, self.n

    @property
    def comm_bytes(self) -> int:
        rows, cols = self.comm_shape
        return rows * cols * self.elem_bytes

    @property
    def shape_str(self) -> str:
        if self.is_fused:
            return f"{self.m}x{self.n}x{self.k}"
        rows, cols = self.comm_shape
        return f"{rows}x{cols}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            m_local=self.m_local,
            n_local=self.n_local,
            k_local=self.k_local,
            flops_per_gpu=self.flops,
            comm_rows=self.comm_shape[0],
            comm_cols=self.comm_shape[1],
            comm_bytes=self.comm_bytes,
            shape=self.shape_str,
        )
        return d


def problem_for(op: str, m: int, layer: Layer, world: int, dtype: str = "bf16") -> Problem:
    if op in ("ag_gemm", "all_gather"):
        n, k = layer.ag_n, layer.ag_k
    elif op in ("gemm_rs", "reduce_scatter"):
        n, k = layer.rs_n, layer.rs_k
    else:
        raise ValueError(f"unknown op {op!r}")
    return Problem(op=op, label=layer.name, m=m, n=n, k=k, world=world, dtype=dtype)


def validate(p: Problem) -> Optional[str]:
    """None if ``p`` can run on ``p.world`` ranks, else the reason it cannot."""
    if p.op not in OPS:
        return f"unknown op {p.op!r}"
    if p.dtype not in DTYPE_BYTES:
        return f"unknown dtype {p.dtype!r}"
    if p.world < 1:
        return f"world must be >= 1, got {p.world}"
    if min(p.m, p.n, p.k) <= 0:
        return f"M, N, K must be positive, got {p.m}x{p.n}x{p.k}"
    if p.m % p.world:
        return f"M={p.m} is not divisible by world={p.world}"
    if p.op == "ag_gemm" and p.n % p.world:
        return f"N={p.n} (split over ranks for ag_gemm) is not divisible by world={p.world}"
    if p.op == "gemm_rs" and p.k % p.world:
        return f"K={p.k} (split over ranks for gemm_rs) is not divisible by world={p.world}"
    return None


def build_problems(
    ops: Sequence[str],
    world: int,
    *,
    dtype: str = "bf16",
    shapes: Optional[Sequence[Tuple[int, int, int]]] = None,
    quick: bool = False,
    ms: Optional[Iterable[int]] = None,
) -> List[Tuple[Problem, Optional[str]]]:
    """All (problem, reason-it-cannot-run-or-None) pairs of a sweep, in run order.

    Order: by layer, then M, then op (so a fused op and its collective share
    cached inputs / measurements).
    """
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}")
    pairs: List[Tuple[int, Layer]] = []
    if shapes:
        pairs = custom_layers(shapes)
    else:
        layers = quick_layers(world) if quick else list(LAYERS.values())
        m_values = list(ms) if ms else list(QUICK_MS if quick else DEFAULT_MS)
        if quick:
            m_values = [round_up(m, world) for m in m_values]
        pairs = [(m, layer) for layer in layers for m in m_values]
    out = []
    for m, layer in pairs:
        for op in ops:
            p = problem_for(op, m, layer, world, dtype)
            out.append((p, validate(p)))
    return out


def rotation_sets(
    bytes_per_set: int,
    l2_bytes: int,
    budget_bytes: Optional[int] = None,
    *,
    l2_multiple: float = 4.0,
    min_sets: int = 2,
    max_sets: int = 8,
) -> int:
    """How many input sets to rotate through so consecutive iterations do not hit in L2.

    Enough sets that the rotated footprint is ``l2_multiple`` times the L2
    size, clamped to [min_sets, max_sets] and to ``budget_bytes`` (never < 1).
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    want = math.ceil(l2_multiple * max(l2_bytes, 0) / bytes_per_set)
    n = max(min_sets, min(max_sets, want))
    if budget_bytes is not None:
        n = min(n, max(1, int(budget_bytes // bytes_per_set)))
    return max(1, n)
