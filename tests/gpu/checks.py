"""GPU checks run under mpirun (tests/test_gpu.py launches this; also usable by hand):

    flux-launch -n 2 tests/gpu/checks.py runtime collectives      # named groups, or "all"
    flux-launch -n 2 tests/gpu/checks.py nn                       # flux_shmem.nn layers and the Llama block
    flux-launch -n 2 tests/gpu/checks.py moe                      # the MoE ops
    torchrun --nproc-per-node 2 tests/gpu/checks.py nn            # the same, bootstrapped by torchrun
    FLUX_SHMEM_ON_TIMEOUT=raise flux-launch -n 1 tests/gpu/checks.py timeout_raise
    flux-launch -n 1 tests/gpu/checks.py timeout_trap                # expected to die with a report

Every check compares with a torch reference on fresh random inputs, outputs poisoned first. Prints
"CHECK <name> ok" per passed check on rank 0; any failure raises (non-zero exit). The checks live in one module per
group family (runtime_checks, gemm_checks, fp8_checks, hazard_checks, emulation_checks, nn_checks, timeout_checks,
sweep_checks, moe_checks), sharing common.py's registry and helpers; this file picks and runs them.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository root on sys.path too)
import flux_shmem  # noqa: E402
# every group (each module registers its checks in CHECKS, in the order it defines them)
import runtime_checks, gemm_checks, fp8_checks, hazard_checks, emulation_checks  # noqa: E401,E402,F401
import nn_checks, timeout_checks, sweep_checks, moe_checks  # noqa: E401,E402,F401
from common import CHECKS, Skip, rel_err  # noqa: E402,F401  (rel_err: for tests/gpu/torchrun_check.py)


def plan_for(groups: list[str]) -> list:
    """(group, check) pairs for group names or check names ("all": every group but the timeouts)."""
    if groups == ["all"]:
        groups = ["runtime", "collectives", "gemm", "hazards", "nn"]
    by_name = {fn.__name__: (g, fn) for g, fns in CHECKS.items() for fn in fns}
    return [(g, fn) for name in groups for g, fn in ([(name, f) for f in CHECKS[name]] if name in CHECKS
                                                     else [by_name[name]])]


def run_checks(rt, plan) -> int:
    """Run the checks; prints "CHECK <name> ok" (rank 0) or the failure (every failing PE). Returns failures."""
    failures = 0
    for g, fn in plan:
        t0 = time.time()
        try:
            fn(rt)
            torch.cuda.synchronize()
            if "timeout" not in g:
                flux_shmem.check_errors()
            if rt.rank == 0:
                print(f"CHECK {fn.__name__} ok ({time.time() - t0:.1f} s, world {rt.world_size}, "
                      f"node_size {rt.node_size}, launcher {rt.launcher})", flush=True)
        except Skip as e:
            if rt.rank == 0:
                print(f"CHECK {fn.__name__} skip: {e} (world {rt.world_size})", flush=True)
        except Exception:
            failures += 1
            print(f"CHECK {fn.__name__} FAILED on PE {rt.rank}:\n{traceback.format_exc()}", flush=True)
            if "timeout" in g:
                raise
    return failures


def main(argv: list[str]) -> int:
    plan = plan_for(argv or ["all"])
    rt = flux_shmem.init()  # mpirun / flux-launch or torchrun, detected
    failures = run_checks(rt, plan)
    flux_shmem.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
