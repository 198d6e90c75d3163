#!/usr/bin/env python3
"""Overlap benchmark sweep for flux_shmem's fused tensor-parallel ops.

    flux-launch -n 8 benchmarks/run.py --quick
    flux-launch -n 8 benchmarks/run.py --jsonl out.jsonl --plot-dir plots/
    flux-launch -n 16 benchmarks/run.py --force-put --ops ag_gemm,gemm_rs

See benchmarks/README.md for the columns and the model.  Exit codes: 0 ok,
1 a correctness check failed, 2 bad arguments, 3 no CUDA device visible.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if __package__ in (None, ""):
    # Run as a script: import `benchmarks` as a package from the repo root, and
    # keep benchmarks/ itself off sys.path so its module names shadow nothing.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
from typing import List, Optional, Sequence  # noqa: E402

from benchmarks import shapes as _shapes  # noqa: E402  (pure python, cheap)

__all__ = ["main", "parse_args", "build_parser", "EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_USAGE", "EXIT_NO_GPU"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_GPU = 3

PROG = "benchmarks/run.py"
# --emulate-link presets: (GB/s per direction of one whole GPU, latency us). Scaled by the SM share below.
EMULATED_LINKS = {"nvlink": (360.0, 1.5), "ib": (40.0, 5.0)}


def emulation_env(preset: str, share: float) -> dict:
    """FLUX_SHMEM_LINK_* for a preset, its bandwidth scaled by the SM share: a PE with half the SMs runs its GEMM at
    half speed, so half the link keeps the ratio of communication to GEMM time of a whole GPU on a real link."""
    gbps, lat = EMULATED_LINKS[preset]
    if not 0 < share <= 1:
        raise ValueError(f"SM share must be in (0, 1], got {share}")
    return {"FLUX_SHMEM_LINK_GBPS": f"{gbps * share:.3f}", "FLUX_SHMEM_LINK_LATENCY_US": f"{lat:g}"}
DEFAULT_ITERS, DEFAULT_WARMUP = 100, 10
QUICK_ITERS, QUICK_WARMUP = 20, 5


def _shapes_arg(text: str):
    try:
        return _shapes.parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ops_arg(text: str):
    try:
        return _shapes.parse_ops(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Sweep AllGather+GEMM, GEMM+ReduceScatter and the standalone collectives against "
        "NCCL+cuBLAS (serial and two-stream chunked) and torch SymmetricMemory. Launch with "
        "`flux-launch -n N benchmarks/run.py ...` (one MPI rank per GPU, any number of nodes).",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"2 small shapes (M in {{4096, 8192}}, per-GPU N=K=4096), {QUICK_ITERS} iterations, "
                        f"{QUICK_WARMUP} warm-up")
    p.add_argument("--shapes", type=_shapes_arg, default=None, metavar="MxNxK[,MxNxK...]",
                   help="global GEMM shapes to run instead of the default sweep (N is split over ranks for "
                        "ag_gemm, K for gemm_rs; all_gather moves [M,K], reduce_scatter [M,N]), or a suite of "
                        "per-GPU shapes: tp-shard, tp-shard-quick (benchmarks/shapes.py)")
    p.add_argument("--ops", type=_ops_arg, default=list(_shapes.OPS), metavar="OP[,OP...]",
                   help=f"ops to run, from {','.join(_shapes.OPS)} (default: all); or `block` alone: the Llama TP "
                        "block benchmark (benchmarks/llama_block.py, which takes its own options); or `moe` alone: "
                        "the MoE layers (benchmarks/moe.py, its own options)")
    p.add_argument("--dtype", choices=sorted(_shapes.DTYPE_BYTES), default="bf16")
    p.add_argument("--iters", type=_positive_int, default=None,
                   help=f"timed iterations per configuration (default {DEFAULT_ITERS}, --quick {QUICK_ITERS})")
    p.add_argument("--warmup", type=_nonneg_int, default=None,
                   help=f"untimed warm-up iterations (default {DEFAULT_WARMUP}, --quick {QUICK_WARMUP})")
    p.add_argument("--rounds", type=_positive_int, default=5, metavar="R",
                   help="split each configuration's timed iterations into R rounds that alternate the order of the "
                        "implementations, so clock/power drift hits all alike (default 5)")
    p.add_argument("--rotate", type=_positive_int, default=None, metavar="N",
                   help="input sets to rotate through (default: enough to cover 4x the L2 cache, 2..8)")
    p.add_argument("--jsonl", default=None, metavar="PATH", help="write one JSON object per configuration")
    p.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots (speedup, overlap efficiency)")
    p.add_argument("--ag-engine", choices=("auto", "sm", "ce"), default="auto",
                   help="AllGatherGEMM's all-gather: 'sm' (gather kernel on a few SMs), 'ce' (copy engines, one "
                        "NVLink domain only) or 'auto' (the one the simulator predicts faster, per M)")
    p.add_argument("--mode", choices=("auto", "fused"), default="auto",
                   help="our fused ops' mode ('auto' may take the decomposed path where fusing would not pay; a "
                        "'decomposed' twin is always measured beside)")
    p.add_argument("--comm-blocks", type=_positive_int, default=None, metavar="N",
                   help="thread blocks of our communication kernels (default: the split the simulator predicts "
                        "fastest)")
    p.add_argument("--rs-group-tiles", type=_positive_int, default=None, metavar="N",
                   help="GEMMReduceScatter's fused reduce units N N-tiles wide (large: whole rows; default: the "
                        "planner's choice)")
    p.add_argument("--emulate-link", choices=tuple(EMULATED_LINKS), default=None,
                   help="pace every peer transfer of our comm engines like an NVLink or InfiniBand link, scaled by "
                        "this process's SM share (several PEs on one GPU under CUDA MPS): real overlap of the real "
                        "kernels against a realistic link; said in every table and JSON record")
    p.add_argument("--force-put", action="store_true",
                   help="set FLUX_SHMEM_FORCE_PUT=1 before flux_shmem.init(): every peer's data goes through "
                        "NVSHMEM put/signal (the inter-node path), also within a node")
    p.add_argument("--nvlink-gbps", type=_positive_float, default=360.0,
                   help="model: achievable NVLink GB/s per direction per GPU (nominal 450)")
    p.add_argument("--ib-gbps", type=_positive_float, default=40.0,
                   help="model: achievable IB GB/s per NIC (nominal 50)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="model: GPUs per node (default: as detected)")
    p.add_argument("--latency-us", type=_nonneg_float, default=10.0, help="model: fixed per-op latency in us")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    return p


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> argparse.Namespace:
    """Parse and resolve defaults (``--quick`` iterations); exits with code 2 on bad arguments."""
    args = build_parser(prog).parse_args(None if argv is None else list(argv))
    if args.iters is None:
        args.iters = QUICK_ITERS if args.quick else DEFAULT_ITERS
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    return args


def _env_rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"):
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return 0


def no_gpu_reason() -> Optional[str]:
    """Why this process cannot benchmark (None if a CUDA device is visible). Imports torch only."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch is not importable ({type(e).__name__}: {e})"
    try:
        ok = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    return None


def block_argv(argv: Sequence[str], which: str = "block") -> Optional[List[str]]:
    """`--ops block` (`which`) asks for the Llama TP block benchmark (`--ops moe`: the MoE one): its arguments
    (the rest), else None."""
    for i, a in enumerate(argv):
        if a == "--ops" and i + 1 < len(argv) and argv[i + 1] == which:
            return list(argv[:i]) + list(argv[i + 2:])
        if a == f"--ops={which}":
            return list(argv[:i]) + list(argv[i + 1:])
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the sweep; returns the process exit code (see module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = block_argv(argv)
    if rest is not None:  # benchmarks/llama_block.py, with its own options
        from benchmarks import llama_block
        return llama_block.main(rest)
    rest = block_argv(argv, "moe")
    if rest is not None:  # benchmarks/moe.py, with its own options
        from benchmarks import moe
        return moe.main(rest)
    args = parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        if _env_rank() == 0:
            print(f"{PROG}: cannot run: {reason}; these benchmarks need NVIDIA GPUs "
                  f"(launch with `flux-launch -n N benchmarks/run.py`)", file=sys.stderr, flush=True)
        return EXIT_NO_GPU
    return _run(args)


# ----------------------------------------------------------------------------- GPU path


def _git_commit() -> Optional[str]:
    import subprocess

    try:
        sha = subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(["git", "-C", _ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return None


def _run(args: argparse.Namespace) -> int:
    import datetime
    import socket

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    mpi_local_rank, mpi_local_size = node_comm.Get_rank(), node_comm.Get_size()
    node_comm.Free()
    is_root = rank == 0

    def say(*a):
        if is_root:
            print(*a, file=sys.stderr, flush=True)

    if args.force_put:
        os.environ["FLUX_SHMEM_FORCE_PUT"] = "1"

    import torch

    torch.cuda.set_device(mpi_local_rank % max(torch.cuda.device_count(), 1))
    # flux_shmem: its absence makes "ours" unavailable, the baselines still run.
    flux, rt, flux_error = None, None, None
    try:
        import flux_shmem

        rt = flux_shmem.init()
        flux = flux_shmem
    except Exception as e:  # noqa: BLE001
        flux_error = f"flux_shmem.init() failed: {type(e).__name__}: {e}"
    errors = [e for e in comm.allgather(flux_error) if e]
    if errors and flux is not None:
        flux_error = errors[0]  # some other rank failed: do not use (or finalize) it anywhere
        flux = None
    elif errors:
        flux_error = errors[0]
    if flux_error:
        say(f"{PROG}: warning: {flux_error}; measuring the baselines only")

    # After init: a green-context partition (FLUX_SHMEM_SM_PARTITION=green) is made there and is the budget. The
    # link emulation is read when the ops are built, below.
    from flux_shmem.runtime.sm_budget import sm_budget

    budget = sm_budget(torch.cuda.current_device())
    emulated = None
    if args.emulate_link:
        env = emulation_env(args.emulate_link, budget.share)
        os.environ.update(env)
        gbps, lat = EMULATED_LINKS[args.emulate_link]
        emulated = {"preset": args.emulate_link, "gbps": float(env["FLUX_SHMEM_LINK_GBPS"]), "latency_us": lat,
                    "sm_share": budget.share, "how": f"{gbps:g} GB/s x SM share {budget.share:.3f} "
                                                   f"({budget.sms} of {budget.device_sms} SMs, {budget.source})"}


    local_size = getattr(rt, "local_size", mpi_local_size) if flux is not None else mpi_local_size
    num_nodes = getattr(rt, "num_nodes", None) if flux is not None else None
    if num_nodes is None:
        num_nodes = len(set(comm.allgather(socket.gethostname())))
    # the CUDA device flux_shmem chose (torch's current device after init), else local rank modulo GPUs
    device = getattr(rt, "device", None) if flux is not None else None
    if not isinstance(device, int):
        device = torch.cuda.current_device()
    torch.cuda.set_device(device)

    from benchmarks import baselines, model, report
    from benchmarks.suite import Suite

    nccl_error = None
    if baselines.gpus_shared(comm):
        nccl_error = "several ranks share one GPU (NCCL, and so every torch baseline, needs one GPU per rank)"
        say(f"{PROG}: warning: {nccl_error}; timing our ops only (references computed through MPI)")
    else:
        baselines.init_torch_distributed(comm, rank, world, device)

    problems = _shapes.build_problems(args.ops, world, dtype=args.dtype, shapes=args.shapes, quick=args.quick)
    if args.shapes:
        bad = [(p, why) for p, why in problems if why]
        if bad:
            for p, why in bad:
                say(f"{PROG}: error: --shapes {p.m}x{p.n}x{p.k} cannot run {p.op} on {world} ranks: {why}")
            _cleanup(flux, None)
            return EXIT_USAGE

    gpn = args.gpus_per_node or local_size
    if emulated:  # the model sees the paced link, one GPU's share of SMs
        hw: Optional[model.Hardware] = model.Hardware(emulated["gbps"], emulated["gbps"], gpn, args.latency_us,
                                                      sms=budget.sms, emulated=True,
                                                      link_latency_us=emulated["latency_us"])
    else:
        hw = model.Hardware(args.nvlink_gbps, args.ib_gbps, gpn, args.latency_us, sms=budget.sms)
    try:
        model.topology(world, gpn)
    except ValueError as e:
        say(f"{PROG}: warning: model disabled: {e}")
        hw = None

    flux_version = getattr(flux, "__version__", None) if flux is not None else None
    config = {
        "type": "config",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": torch.cuda.get_device_name(device),
        "world": world,
        "nodes": num_nodes,
        "gpus_per_node": local_size,
        "dtype": args.dtype,
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "rotate": args.rotate,
        "quick": args.quick,
        "ops": args.ops,
        "force_put": bool(args.force_put),
        "ag_engine": args.ag_engine,
        "mode": args.mode,
        "comm_blocks": args.comm_blocks,
        "rs_group_tiles": args.rs_group_tiles,
        "sm_budget": {"sms": budget.sms, "device_sms": budget.device_sms, "source": budget.source},
        "emulated_link": emulated,
        "force_put_runtime": getattr(rt, "force_put", None) if flux is not None else None,
        "command": " ".join([os.path.relpath(sys.argv[0], _ROOT) if sys.argv and sys.argv[0] else PROG]
                            + sys.argv[1:]),
        "commit": _git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        "flux_shmem": flux_version if flux is not None else flux_error,
        "baselines": "ok" if nccl_error is None else "unavailable: " + nccl_error,
        "model": None if hw is None else {
            "nvlink_gbps": hw.nvlink_gbps, "ib_gbps": hw.ib_gbps, "gpus_per_node": hw.gpus_per_node,
            "latency_us": hw.latency_us},
    }
    writer = report.JsonlWriter(args.jsonl) if (is_root and args.jsonl) else None
    if writer:
        writer.write(config)

    header = (f"flux_shmem overlap benchmarks | world {world} ({num_nodes} node(s), {local_size} GPU(s)/node) | "
              f"{config['device']} | {args.dtype} | iters {args.iters} warmup {args.warmup} | "
              f"force_put {'on' if args.force_put else 'off'} | ag_engine {args.ag_engine} | mode {args.mode} | "
              f"SMs {budget.sms}/{budget.device_sms} | "
              + (f"EMULATED {args.emulate_link} link: {emulated['how']} = {emulated['gbps']:g} GB/s | " if emulated
                 else "") + f"commit {config['commit']}")
    say(f"{PROG}: {len(problems)} configuration(s) on {world} rank(s): {header.split(' | ', 1)[1]}")

    suite = Suite(comm=comm, rank=rank, world=world, local_rank=device, flux=flux, flux_error=flux_error,
                  dtype=args.dtype, iters=args.iters, warmup=args.warmup, rotate=args.rotate, seed=args.seed,
                  verbose=args.verbose, nccl_error=nccl_error, rounds=args.rounds,
                  op_options={"AllGatherGEMM": {"engine": args.ag_engine, "comm_blocks": args.comm_blocks},
                              "GEMMReduceScatter": {"comm_blocks": args.comm_blocks,
                                                    "group_tiles": args.rs_group_tiles}},
                  mode=args.mode)
    suite.plan([p for p, why in problems if why is None])
    config["timing"] = (f"per call after a host sync + MPI barrier, then a {suite.lead_us:g} us GPU lead (device time, "
                        "not the host's launch path)" if suite.lead_us else "per call after an NCCL all-reduce")
    say(f"{PROG}: timing {config['timing']}")
    if writer:
        writer.write({"type": "timing", "protocol": config["timing"]})
    progress = report.Progress(len(problems), enabled=is_root and not args.no_progress)
    records: List[dict] = []
    failures = 0
    extra = {"force_put": bool(args.force_put), "iters": args.iters, "warmup": args.warmup, "nodes": num_nodes,
             "emulated_link": emulated["how"] if emulated else None, "sm_budget": budget.sms}
    try:
        for p, why in problems:
            if why is None:
                impls, err = None, None
                try:
                    impls = suite.run(p)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory building inputs; keep sweeping
                    err = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                err = next((e for e in comm.allgather(err) if e), None)
                if err:
                    say(f"{PROG}: {p.op} {p.label} {p.shape_str}: {err}")
                    rec = report.build_record(p, {}, skipped=err, extra=extra)
                else:
                    rec = report.build_record(p, impls, hw=hw, extra=extra)
            else:
                rec = report.build_record(p, {}, skipped=why, extra=extra)
            failures += len(rec.get("checks_failed", []))
            if is_root:
                records.append(rec)
                if writer:
                    writer.write(rec)
            progress.step(f"{p.op} {p.label} {p.shape_str}")
    finally:
        progress.close()
        if writer:
            writer.close()
        suite.close()

    if is_root:
        print(report.format_table(records, header=header), flush=True)
        if args.plot_dir:
            paths = report.write_plots(records, args.plot_dir, title_suffix=f"world {world}, {args.dtype}")
            say(f"{PROG}: wrote {len(paths)} plot(s) to {args.plot_dir}")
        if args.jsonl:
            say(f"{PROG}: wrote {len(records) + 1} JSON line(s) to {args.jsonl}")
        if failures:
            say(f"{PROG}: {failures} correctness check(s) FAILED (see the check column)")
    _cleanup(flux, comm)
    return EXIT_CHECK_FAILED if failures else EXIT_OK


def _cleanup(flux, comm) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if comm is not None:
        comm.Barrier()
    if flux is not None:
        flux.finalize()


if __name__ == "__main__":
    sys.exit(main())
