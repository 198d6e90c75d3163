#!/usr/bin/env python3
"""One Llama-3-70B-style tensor-parallel block, sequence parallel, forward and forward+backward:
flux_shmem.nn layers (fused ops) against the same block on plain torch TP (NCCL all-gather / reduce-scatter +
torch.matmul) and on torch async-TP (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter).

    flux-launch -n 8 benchmarks/llama_block.py                 # = benchmarks/run.py --ops block
    torchrun --nproc-per-node 8 benchmarks/llama_block.py --quick
    flux-launch -n 2 benchmarks/llama_block.py --quick         # 2 PEs on one GPU: correctness + our timings only

The block ([s, b, h] layout, PE r holds sequence positions [r*s/W, (r+1)*s/W) between the layers):
    x = x + o_proj(attention(qkv(rms_norm(x))))       qkv column-parallel, o_proj row-parallel
    x = x + down(silu(gate) * up),  gate, up = gate_up(rms_norm(x))   gate_up column-parallel, down row-parallel
rms_norm has no weight, and `attention` is a stand-in by default ('elementwise': q * sigmoid(k) + v per head, the
kv heads broadcast over their query group): the benchmark is about the projections and their communication,
which are identical to a real block; `--attention sdpa` runs causal scaled-dot-product attention instead.

First every implementation's output and every gradient (input and each weight) is compared with an unsharded
fp32 torch reference that every PE computes from the same seed; then CUDA-event timings, medians (max over PEs),
in rounds that alternate the implementations. Exit codes as benchmarks/run.py: 0 ok, 1 a check failed, 2 bad
arguments, 3 no GPU.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repo root (as run.py does)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from typing import Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

PROG = "benchmarks/llama_block.py"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
TOL = 1e-2  # relative error (Frobenius) of bf16/fp16 outputs and gradients against the fp32 reference
IMPLS = ("flux", "torch", "symm_mem")


# ------------------------------------------------------------------------------------------------ the block
@dataclasses.dataclass(frozen=True)
class BlockConfig:
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 28672
    bias: bool = False          # Llama has none; the checks turn it on to cover the bias gradients
    attention: str = "elementwise"

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def check_world(self, world: int) -> None:
        for what, v in (("heads", self.heads), ("kv_heads", self.kv_heads), ("ffn", self.ffn),
                        ("hidden", self.hidden)):
            if v % world:
                raise ValueError(f"{what} = {v} does not split over {world} PEs")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads = {self.heads} is not a multiple of kv_heads = {self.kv_heads}")
        if self.attention not in ("elementwise", "sdpa"):
            raise ValueError(f"attention must be 'elementwise' or 'sdpa', got {self.attention!r}")


LLAMA3_70B = BlockConfig()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
              kind: str) -> torch.Tensor:
    """q [s, b, heads*d], k and v [s, b, kv_heads*d] -> [s, b, heads*d]; each kv head serves heads/kv_heads
    consecutive query heads (grouped-query attention), so a PE's local heads need only its local kv heads."""
    s, b = q.shape[0], q.shape[1]
    group = heads // kv_heads
    q5 = q.reshape(s, b, kv_heads, group, head_dim)
    k5 = k.reshape(s, b, kv_heads, 1, head_dim)
    v5 = v.reshape(s, b, kv_heads, 1, head_dim)
    if kind == "elementwise":
        out = q5 * torch.sigmoid(k5) + v5
    else:
        def heads_first(t):  # [s, b, kv, group, d] -> [b, heads, s, d]
            return t.expand(s, b, kv_heads, group, head_dim).reshape(s, b, heads, head_dim).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(heads_first(q5), heads_first(k5), heads_first(v5), is_causal=True)
        out = out.permute(2, 0, 1, 3)
    return out.reshape(s, b, heads * head_dim)


def block_forward(x: torch.Tensor, qkv, o_proj, gate_up, down, cfg: BlockConfig, heads: int, kv_heads: int):
    d = cfg.head_dim
    q, k, v = qkv(F.rms_norm(x, (x.shape[-1],))).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    x = x + o_proj(attention(q, k, v, heads, kv_heads, d, cfg.attention))
    gate, up = gate_up(F.rms_norm(x, (x.shape[-1],))).chunk(2, dim=-1)
    return x + down(F.silu(gate) * up)


class ReferenceBlock(nn.Module):
    """The unsharded block on torch.nn.Linear."""

    def __init__(self, cfg: BlockConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": cfg.bias}
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, cfg.qkv_out, **kw)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, **kw)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, **kw)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return block_forward(x, self.qkv, self.o_proj, self.gate_up, self.down, c, c.heads, c.kv_heads)


class TPBlock(nn.Module):
    """The same block on flux_shmem.nn's parallel layers: x [s/W, b, hidden] -> [s/W, b, hidden]."""

    def __init__(self, cfg: BlockConfig, backend=None, device=None, dtype=None):
        super().__init__()
        from flux_shmem.nn import ColumnParallelLinear, RowParallelLinear
        kw = {"backend": backend, "device": device, "dtype": dtype, "bias": cfg.bias}
        self.cfg = cfg
        self.qkv = ColumnParallelLinear(cfg.hidden, cfg.qkv_out, **kw)
        self.o_proj = RowParallelLinear(cfg.heads * cfg.head_dim, cfg.hidden, **kw)
        self.gate_up = ColumnParallelLinear(cfg.hidden, 2 * cfg.ffn, **kw)
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, **kw)
        self.world_size, self.rank = self.qkv.world_size, self.qkv.rank
        cfg.check_world(self.world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, W = self.cfg, self.world_size
        return block_forward(x, self.qkv, self.o_proj, self.gate_up, self.down, c, c.heads // W, c.kv_heads // W)


def shard_full(cfg: BlockConfig, full: Dict[str, torch.Tensor], rank: int, world: int) -> Dict[str, torch.Tensor]:
    """This PE's part of the reference block's tensors (weights or their gradients), keyed like TPBlock's
    parameters: fused QKV and gate/up are split per component (a PE keeps [q_r; k_r; v_r] and [gate_r; up_r]),
    o_proj and down by input columns, their biases whole."""
    d, hq, hkv, f = cfg.head_dim, cfg.heads // world, cfg.kv_heads // world, cfg.ffn // world

    def rows(t, size, base=0):
        return t[base + rank * size: base + (rank + 1) * size]

    def qkv(t):
        return torch.cat([rows(t, hq * d), rows(t, hkv * d, cfg.heads * d),
                          rows(t, hkv * d, (cfg.heads + cfg.kv_heads) * d)])

    out = {"qkv.weight": qkv(full["qkv.weight"]),
           "o_proj.weight": full["o_proj.weight"][:, rank * hq * d:(rank + 1) * hq * d],
           "gate_up.weight": torch.cat([rows(full["gate_up.weight"], f), rows(full["gate_up.weight"], f, cfg.ffn)]),
           "down.weight": full["down.weight"][:, rank * f:(rank + 1) * f]}
    if cfg.bias:
        out["qkv.bias"] = qkv(full["qkv.bias"])
        out["o_proj.bias"] = full["o_proj.bias"]
        out["gate_up.bias"] = torch.cat([rows(full["gate_up.bias"], f), rows(full["gate_up.bias"], f, cfg.ffn)])
        out["down.bias"] = full["down.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def seq_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """PE `rank`'s sequence positions of a [s, ...] tensor."""
    s = t.shape[0] // world
    return t[rank * s:(rank + 1) * s]


def reference_step(cfg: BlockConfig, x: torch.Tensor, grad_y: torch.Tensor, seed: int, device=None,
                   dtype: torch.dtype = torch.float32, round_to: torch.dtype | None = None):
    """The unsharded block (weights from `seed`, the same on every PE) forward and backward in fp32 (or `dtype`):
    (output, input gradient, {parameter name: gradient}, {parameter name: weight}). `round_to` rounds the weights
    to the dtype the sharded block will hold first, so only the computation differs."""
    torch.manual_seed(seed)
    ref = ReferenceBlock(cfg, device=device, dtype=dtype)
    if round_to is not None:
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(round_to))
    xr = x.detach().to(dtype).requires_grad_(True)
    y = ref(xr)
    y.backward(grad_y.to(dtype))
    grads = {n: p.grad for n, p in ref.named_parameters()}
    weights = {n: p.detach() for n, p in ref.named_parameters()}
    return y.detach(), xr.grad, grads, weights


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare_step(block: TPBlock, x_shard: torch.Tensor, grad_y_shard: torch.Tensor, ref,
                 forward=None) -> Dict[str, float]:
    """Run the TP block (or `forward`, e.g. torch.compile(block)) forward and backward on this PE's shard;
    relative error of the output, the input gradient and every parameter gradient against the reference's part."""
    y_ref, gx_ref, grads_ref, _ = ref
    r, W = block.rank, block.world_size
    for p in block.parameters():
        p.grad = None
    xs = x_shard.detach().clone().requires_grad_(True)
    y = (block if forward is None else forward)(xs)
    y.backward(grad_y_shard)
    errs = {"output": rel_err(y, seq_shard(y_ref, r, W)), "grad input": rel_err(xs.grad, seq_shard(gx_ref, r, W))}
    want = shard_full(block.cfg, grads_ref, r, W)
    for name, p in block.named_parameters():
        errs[f"grad {name}"] = rel_err(p.grad, want[name]) if p.grad is not None else float("inf")
    return errs


def heap_bytes(cfg: BlockConfig, max_m: int, elem: int) -> int:
    """Symmetric heap the block's fused ops need: 8 ops (4 forward, 4 backward), each with one [max_m, hidden]
    buffer (the all-gather's gathered input or the reduce-scatter's partial product: every one of the block's
    products gathers or reduces over `hidden`), plus a quarter and 256 MiB for signals and small buffers."""
    return int(1.25 * 8 * max_m * cfg.hidden * elem) + (256 << 20)


# ------------------------------------------------------------------------------------------------ async-TP backend
class SymmMemBackend:
    """flux_shmem.nn backend on torch's async-TP ops (copy-engine chunks + cuBLAS, one NVLink domain)."""

    name = "symm_mem"

    def __init__(self, group):
        import torch.distributed as dist
        from benchmarks import baselines
        self.group_name = baselines._symm_mem_setup(group)
        self._ag = baselines._symm_op("fused_all_gather_matmul")
        self._rs = baselines._symm_op("fused_matmul_reduce_scatter")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def ag_gemm(self, a_shard, b, bias, return_gathered):
        full, (out,) = self._ag(a_shard.contiguous(), [b], 0, self.group_name, return_A=True)
        return (out if bias is None else out + bias), (full if return_gathered else None)

    def gemm_rs(self, a, b, bias):
        out = self._rs(a.contiguous(), b, "sum", 0, self.group_name)
        return out if bias is None else out + bias


# ------------------------------------------------------------------------------------------------ command line
def _tokens(text: str) -> List[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=_tokens, default=None, metavar="S[,S...]",
                   help="sequence lengths s (all PEs together; batch --batch) to run (default 8192; --quick 2048)")
    p.add_argument("--batch", type=int, default=1, help="batch b of the [s, b, h] activations (default 1)")
    p.add_argument("--quick", action="store_true", help="s = 2048, 10 iterations, 3 warm-up")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"implementations, from {','.join(IMPLS)}")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--attention", choices=("elementwise", "sdpa"), default="elementwise")
    p.add_argument("--mode", choices=("auto", "fused", "decomposed"), default="auto",
                   help="the fused ops' mode (default auto)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 50, --quick 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5, --quick 3)")
    p.add_argument("--rounds", type=int, default=5, help="rounds alternating the implementations (default 5)")
    p.add_argument("--check-only", action="store_true", help="correctness checks only, no timings")
    p.add_argument("--force-put", action="store_true", help="FLUX_SHMEM_FORCE_PUT=1 (the inter-node path)")
    p.add_argument("--jsonl", default=None, metavar="PATH", help="write one JSON object per (s, implementation)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)  # accepted for run.py parity
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(None if argv is None else list(argv))
    args.tokens = args.tokens or ([2048] if args.quick else [8192])
    args.iters = args.iters or (10 if args.quick else 50)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        build_parser().error(f"--impls: unknown {','.join(bad) or '(none)'}; choose from {','.join(IMPLS)}")
    args.impls = impls
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        if os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
            print(f"{PROG}: cannot run: no CUDA device visible (torch.cuda.is_available() is False); this benchmark "
                  "needs NVIDIA GPUs (flux-launch -n N benchmarks/llama_block.py)", file=sys.stderr, flush=True)
        return EXIT_NO_GPU
    return _run(args)


# ------------------------------------------------------------------------------------------------ GPU path
def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import flux_shmem
    from benchmarks import baselines, metrics, timing
    from flux_shmem.nn import FusedBackend, TorchBackend

    if args.force_put:
        os.environ["FLUX_SHMEM_FORCE_PUT"] = "1"
    max_m = max(args.tokens) * args.batch
    heap = None if "NVSHMEM_SYMMETRIC_SIZE" in os.environ else heap_bytes(LLAMA3_70B, max_m, 2)
    rt = flux_shmem.init(heap_size=heap)
    W, r = rt.world_size, rt.rank
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if r == 0 else (lambda *a: None)
    cfg = dataclasses.replace(LLAMA3_70B, attention=args.attention)
    try:
        cfg.check_world(W)
        for s in args.tokens:
            if s % W:
                raise ValueError(f"--tokens {s} is not a multiple of the {W} PEs")
    except ValueError as e:
        say(f"{PROG}: error: {e}")
        flux_shmem.finalize()
        return EXIT_USAGE
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device("cuda", rt.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is real fp32
    torch.backends.cudnn.allow_tf32 = False

    nccl_error = None
    if baselines.gpus_shared(rt.host):
        nccl_error = "several PEs share one GPU (NCCL and async-TP need one GPU per PE)"
    elif not dist.is_initialized():
        if rt.launcher != "mpi":
            nccl_error = "torch.distributed is not initialised"
        else:
            baselines.init_torch_distributed(rt.comm, r, W, rt.device)
    if nccl_error is None and "nccl" not in str(dist.get_backend()):
        nccl_error = f"the default process group has no NCCL backend ({dist.get_backend()})"
    if nccl_error:
        say(f"{PROG}: warning: {nccl_error}: checking and timing flux_shmem only")

    fused = FusedBackend(mode=args.mode, max_m=max_m)  # one pool for every s: each op is built once

    def make_backend(impl: str):
        if impl == "flux":
            return fused
        if nccl_error is not None:
            raise baselines.Unavailable(nccl_error)
        return TorchBackend() if impl == "torch" else SymmMemBackend(dist.group.WORLD)

    if nccl_error is None:
        flag = torch.zeros(1, device=device)
        sync = lambda: dist.all_reduce(flag)  # noqa: E731  (lines the PEs up on the device, no host round trip)
    else:
        def sync():
            torch.cuda.synchronize()
            rt.host.barrier()

    records: List[dict] = []
    failures = 0
    for s in args.tokens:
        gen = torch.Generator(device=device).manual_seed(args.seed + s)
        x = torch.randn((s, args.batch, cfg.hidden), generator=gen, device=device).to(dtype)
        grad_y = torch.randn((s, args.batch, cfg.hidden), generator=gen, device=device).to(dtype)
        ref = reference_step(cfg, x, grad_y, args.seed, device=device, round_to=dtype)
        shard = {n: t.to(dtype) for n, t in shard_full(cfg, ref[3], r, W).items()}
        x_shard, gy_shard = seq_shard(x, r, W).to(dtype).contiguous(), seq_shard(grad_y, r, W).to(dtype).contiguous()
        runs: Dict[str, dict] = {}
        for impl in args.impls:
            entry: dict = {"status": "ok"}
            try:
                block = TPBlock(cfg, backend=make_backend(impl), device=device, dtype=dtype)
                block.load_state_dict(shard)
                errs = compare_step(block, x_shard, gy_shard, ref)
                torch.cuda.synchronize()
                entry.update(block=block, errs=errs)
            except Exception as e:  # noqa: BLE001 - recorded; the other implementations still run
                entry["status"] = f"unavailable: {e}" if isinstance(e, baselines.Unavailable) else \
                    f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                if args.verbose:
                    import traceback
                    traceback.print_exc()
            statuses = rt.host.allgather(entry["status"])
            entry["status"] = next((st for st in statuses if st != "ok"), "ok")
            if entry["status"] == "ok":
                worst = rt.host.allgather(entry["errs"])  # per PE
                entry["errs"] = {k: max(e[k] for e in worst) for k in worst[0]}
                entry["ok"] = all(v <= TOL for v in entry["errs"].values())
                failures += 0 if entry["ok"] else 1
            runs[impl] = entry
        del ref
        torch.cuda.empty_cache()

        if not args.check_only:
            ok_impls = [i for i in args.impls if runs[i]["status"] == "ok"]
            samples: Dict[str, Dict[str, List[float]]] = {i: {"fwd": [], "fwd_bwd": []} for i in ok_impls}
            rounds = max(1, min(args.rounds, args.iters))
            per_round = [args.iters // rounds + (1 if k < args.iters % rounds else 0) for k in range(rounds)]
            xs = x_shard.detach().clone().requires_grad_(True)

            def fwd(block):
                return lambda: block(xs)

            def fwd_bwd(block):
                def step():
                    for p in block.parameters():
                        p.grad = None
                    xs.grad = None
                    block(xs).backward(gy_shard)
                return step

            for k, n in enumerate(per_round):
                for impl in (ok_impls if k % 2 == 0 else ok_impls[::-1]):
                    block = runs[impl]["block"]
                    for what, make in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                        samples[impl][what] += timing.cuda_time(make(block), [()], warmup=args.warmup if k == 0
                                                                else 1, iters=n, sync=sync)
            for impl in ok_impls:
                for what in ("fwd", "fwd_bwd"):
                    runs[impl][f"{what}_ms"] = max(rt.host.allgather(metrics.median(samples[impl][what])))

        for impl in args.impls:
            e = runs[impl]
            rec = {"type": "result", "tokens": s, "batch": args.batch, "world": W, "impl": impl,
                   "dtype": args.dtype, "status": e["status"], "attention": cfg.attention, "mode": args.mode,
                   "shares_gpu": rt.shares_gpu, "fwd_ms": e.get("fwd_ms"), "fwd_bwd_ms": e.get("fwd_bwd_ms"),
                   "errors": e.get("errs"), "ok": e.get("ok"), "tol": TOL}
            records.append(rec)
            e.pop("block", None)
        torch.cuda.empty_cache()

    if r == 0:
        print(format_table(records, header=f"Llama-3-70B TP block | world {W} | {torch.cuda.get_device_name(device)} | "
                                             f"{args.dtype} | attention {cfg.attention} | mode {args.mode}"
                                             + (" | PEs share one GPU: timings are not communication" if
                                                rt.shares_gpu else "")), flush=True)
        if args.jsonl:
            with open(args.jsonl, "w") as f:
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
        if failures:
            say(f"{PROG}: {failures} correctness check(s) FAILED")
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    flux_shmem.finalize()
    return EXIT_CHECK_FAILED if failures else EXIT_OK


def format_table(records: List[dict], header: str = "") -> str:
    """One row per (tokens, implementation): times, speedup over plain torch TP, worst errors, check."""
    lines = [header] if header else []
    lines.append(f"{'tokens':>7} {'impl':<9} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x torch fwd':>12} "
                 f"{'x torch f+b':>12} {'out err':>9} {'max grad err':>13}  check")
    base = {(r["tokens"], w): r.get(f"{w}_ms") for r in records if r["impl"] == "torch" for w in ("fwd", "fwd_bwd")}

    def ms(v):
        return f"{v:9.3f}" if v else f"{'-':>9}"

    def ratio(rec, what):
        b, v = base.get((rec["tokens"], what)), rec.get(f"{what}_ms")
        return f"{b / v:12.2f}" if b and v else f"{'-':>12}"

    for rec in records:
        errs = rec.get("errors") or {}
        grad = max((v for k, v in errs.items() if k.startswith("grad")), default=None)
        check = ("ok" if rec["ok"] else "FAIL") if rec["status"] == "ok" else rec["status"]
        lines.append(f"{rec['tokens']:>7} {rec['impl']:<9} {ms(rec.get('fwd_ms'))} {ms(rec.get('fwd_bwd_ms')):>11} "
                     f"{ratio(rec, 'fwd')} {ratio(rec, 'fwd_bwd')} "
                     f"{errs.get('output', float('nan')):9.1e} {grad if grad is not None else float('nan'):13.1e}  "
                     f"{check}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
