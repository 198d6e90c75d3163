"""Run under `mpirun -n 2`: the bootstrap up to the point a GPU is needed, with real MPI."""
import json
import sys

from mpi4py import MPI

import flux_shmem
from flux_shmem.runtime import bootstrap, symmetric
from flux_shmem.runtime.host import MpiHost

comm = MPI.COMM_WORLD
host = MpiHost(comm)
report = {}
try:
    flux_shmem.get_runtime()
except flux_shmem.NotInitializedError as e:
    report["not_initialized"] = str(e)
layout, hosts = bootstrap.discover_layout(host)
report["layout"] = [layout.rank, layout.world_size, layout.local_rank, layout.local_size, layout.node,
                    layout.num_nodes]
uid = bootstrap.broadcast_unique_id(host)
report["uid_equal"] = len(set(comm.allgather(bytes(uid._data)))) == 1
try:
    symmetric.agree("test shape", (4, 4 + comm.Get_rank()), host=host, timeout_s=10)
except flux_shmem.SymmetricMismatchError as e:
    report["mismatch"] = str(e)
symmetric.agree("same", (4, 4), host=host, timeout_s=10)
if comm.Get_rank() == 1:  # rank 0 waits alone and must give up instead of hanging
    report["timeout"] = "skipped"
else:
    try:
        symmetric.agree("lonely", 1, host=host, timeout_s=1)
    except flux_shmem.FluxShmemError as e:
        report["timeout"] = str(e)
comm.Barrier()
report["launcher"] = bootstrap.host_collectives().name
try:
    flux_shmem.init()
except flux_shmem.NoGPUError as e:
    report["init"] = str(e)
print("REPORT " + json.dumps(report), flush=True)
sys.exit(0)
