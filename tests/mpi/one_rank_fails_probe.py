"""Run under `mpirun -n 2` (no GPU needed): one rank builds a fused op with a bad setting, the other with good
ones. Every rank must raise, within the runtime's timeout, an error naming the failing rank and its message (the
construction's settings are checked on every PE before any GPU work: collective.all_or_none). Then a rank that
never joins: the other must give up after the timeout instead of hanging. Prints one REPORT line per rank and case.

    python3 tests/mpi/one_rank_fails_probe.py CASE...     CASE: plan_cache, gemm_config, start_event, moe_topk,
                                                                moe_experts, lonely
moe_topk: the last rank asks AllGatherGroupGEMM for more experts per token than it has (a local check);
moe_experts: it builds GroupGEMMReduceScatter for 9 experts, the others for 8 (the agreement's check).
"""
import json
import os
import sys
import time

from mpi4py import MPI

from flux_shmem.runtime import state
from flux_shmem.runtime.host import MpiHost
from flux_shmem.runtime.topology import Layout

TIMEOUT_S = 5.0
BAD = {"plan_cache": ("FLUX_SHMEM_PLAN_CACHE", "many"), "gemm_config": ("FLUX_SHMEM_GEMM_CONFIG", "swizzle=3"),
       "start_event": ("FLUX_SHMEM_START_EVENT", "maybe")}

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# The runtime as init() makes it, but for the GPU parts (which these cases never reach).
state.set_runtime(state.Runtime(host=MpiHost(comm), layout=Layout(rank, size, rank, size, 0, 1), device=0,
                                node_size=size, reachable=(True,) * size, force_put=False, timeout_s=TIMEOUT_S,
                                trap_on_timeout=False, shares_gpu=True))
import flux_shmem  # noqa: E402
import flux_shmem.ops.gemm_rs, flux_shmem.ops.moe  # noqa: E401,E402,F401 (imported before the cases run)

for case in sys.argv[1:]:
    comm.Barrier()
    report = {"case": case, "rank": rank}
    t0 = time.monotonic()
    try:
        if case == "lonely":
            if rank == 1:  # never builds the op: rank 0 must give up
                report.update(error="skipped", seconds=0.0)
                print("REPORT " + json.dumps(report), flush=True)
                continue
            flux_shmem.GEMMReduceScatter(1024, 1024, 1024)
        elif case in ("moe_topk", "moe_experts"):
            last = rank == size - 1
            if case == "moe_topk":
                flux_shmem.AllGatherGroupGEMM(1024, 1024, 256, 8, 9 if last else 2)
            else:
                flux_shmem.GroupGEMMReduceScatter(1024, 1024, 256, 9 if last else 8, 2)
        else:
            var, value = BAD[case]
            if rank == size - 1:
                os.environ[var] = value
            try:
                flux_shmem.GEMMReduceScatter(1024, 1024, 1024)
            finally:
                os.environ.pop(var, None)
        report["error"] = None
    except Exception as e:  # noqa: BLE001 - the report says which
        report.update(error=type(e).__name__, message=str(e))
    report["seconds"] = round(time.monotonic() - t0, 2)
    print("REPORT " + json.dumps(report), flush=True)
    if case == "lonely":
        break  # the host collectives are out of step after a timeout: nothing collective after it
sys.exit(0)
