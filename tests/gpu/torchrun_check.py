"""The nn checks under either launcher, plus a fixed training step whose results are saved per rank and compared
with another launcher's run: `torchrun --nproc-per-node 2` must give what `flux-launch -n 2` gives.

    flux-launch -n 2 -- python3 tests/gpu/torchrun_check.py --save /tmp/fl
    NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tests/gpu/torchrun_check.py \\
        --save /tmp/tr --compare /tmp/fl

Prints "CHECK <name> ok" lines like checks.py (rank 0); exit 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402  (puts the repository root on sys.path too)
import nn_checks  # noqa: E402
import flux_shmem  # noqa: E402


def fixed_step(rt) -> dict:
    """The small Llama block, fused ops, fixed seeds: output, input gradient and every parameter gradient."""
    import flux_shmem.nn as fnn
    from benchmarks.llama_block import seq_shard
    cfg = nn_checks.small_block(rt)
    x, gy, ref = nn_checks.block_case(rt, cfg, 77)
    blk = nn_checks.tp_block(rt, cfg, fnn.FusedBackend(mode="fused"), ref)
    xs = seq_shard(x, rt.rank, rt.world_size).clone().requires_grad_(True)
    y = blk(xs)
    y.backward(seq_shard(gy, rt.rank, rt.world_size))
    torch.cuda.synchronize()
    out = {"output": y.detach().cpu(), "grad input": xs.grad.cpu()}
    out.update({f"grad {n}": p.grad.cpu() for n, p in blk.named_parameters()})
    return out


def compare(mine: dict, other: dict) -> dict:
    """Relative error of each tensor against the other run's (0.0: bitwise equal)."""
    assert set(mine) == set(other), (sorted(mine), sorted(other))
    return {k: 0.0 if torch.equal(mine[k], other[k]) else checks.rel_err(mine[k], other[k]) for k in mine}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("groups", nargs="*", default=["nn"], help="check groups or names of checks.py (default nn)")
    p.add_argument("--save", metavar="DIR", help="write this run's fixed-step results (one file per rank)")
    p.add_argument("--compare", metavar="DIR", help="compare with the results another run saved there")
    p.add_argument("--launcher", choices=("mpi", "torch"), help="fail unless this launcher was detected")
    args = p.parse_args(argv)
    rt = flux_shmem.init()
    failures = 0
    if args.launcher and rt.launcher != args.launcher:
        print(f"CHECK launcher FAILED on PE {rt.rank}: detected {rt.launcher!r}, expected {args.launcher!r}",
              flush=True)
        failures += 1
    failures += checks.run_checks(rt, checks.plan_for(args.groups))
    t0 = time.time()
    status = "ok"
    try:
        results = fixed_step(rt)
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            torch.save(results, os.path.join(args.save, f"rank{rt.rank}.pt"))
        if args.compare:
            other = torch.load(os.path.join(args.compare, f"rank{rt.rank}.pt"))
            errs = compare(results, other)
            worst = max(errs.values())
            assert worst <= 1e-6, f"differs from the run in {args.compare}: {errs}"
            exact = sum(v == 0.0 for v in errs.values())
            print(f"PE {rt.rank}: {exact}/{len(errs)} tensors bitwise equal to {args.compare}, worst rel err "
                  f"{worst:.1e}", flush=True)
    except Exception:
        status = f"FAILED on PE {rt.rank}:\n{traceback.format_exc()}"
    statuses = rt.host.allgather(status)  # every PE gets here, failed or not
    bad = [st for st in statuses if st != "ok"]
    if rt.rank == 0:
        for st in bad:
            print(f"CHECK fixed_step {st}", flush=True)
        if not bad:
            print(f"CHECK fixed_step ok ({time.time() - t0:.1f} s, world {rt.world_size}, launcher {rt.launcher}"
                  f"{', compared with ' + args.compare if args.compare else ''})", flush=True)
    failures += len(bad)
    flux_shmem.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
