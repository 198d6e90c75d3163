"""Bootstrap: the launcher's host collectives give ranks and hosts, rank 0's NVSHMEM unique id is broadcast over
them, NVSHMEM starts. Under mpirun / flux-launch the host collectives are MPI's (mpi4py); under torchrun, or
given a torch.distributed group, torch.distributed's (gloo). Everything after the unique id is one code path.

Works for one PE, for several PEs sharing one GPU (NVSHMEM "limited MPG", where NVSHMEM's own team barriers are
refused, hence flux_shmem's signal barrier), and for one PE per GPU across nodes.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator

from ..errors import FluxShmemError, NoGPUError
from . import partition, signals, stall, symmetric
from .host import MPI, HostCollectives, MpiHost, choose_launcher, mpi_host, torch_host
from .state import LOCK, Runtime, get_runtime, is_initialized, set_runtime
from .topology import Layout, kernel_node_size, layout_from_hosts

__all__ = ["init", "finalize", "session", "get_runtime", "is_initialized", "Runtime", "DEFAULT_TIMEOUT_S",
           "host_collectives", "discover_layout", "broadcast_unique_id"]

# Ranks of a healthy job drift by minutes (first-use kernel builds, checkpoint I/O, data loading): like NCCL's
# watchdog, wait 10 minutes before declaring a peer lost. Tests set FLUX_SHMEM_TIMEOUT_S low.
DEFAULT_TIMEOUT_S = 600.0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def host_collectives(comm=None, group=None) -> HostCollectives:
    """The host collectives `init()` bootstraps over: `comm` (mpi4py), `group` (torch.distributed), or what the
    launcher provides (`host.choose_launcher`: MPI under mpirun / flux-launch, torch.distributed under torchrun)."""
    if comm is not None and group is not None:
        raise ValueError("flux_shmem.init(): pass comm= (an mpi4py communicator) or group= (a torch.distributed "
                         "process group), not both")
    if comm is not None:
        return MpiHost(comm)
    if group is not None:
        return torch_host(group)
    torch_initialized = False
    if "torch.distributed" in sys.modules:  # without importing torch just to ask
        import torch.distributed as dist
        torch_initialized = dist.is_available() and dist.is_initialized()
    if choose_launcher(os.environ, torch_initialized=torch_initialized) == MPI:
        return mpi_host()
    return torch_host()


def discover_layout(host: HostCollectives) -> tuple[Layout, list[str]]:
    """Every PE's host name, and this PE's layout."""
    hosts = host.allgather(host.hostname())
    return layout_from_hosts(hosts, host.rank), hosts


def broadcast_unique_id(host: HostCollectives):
    """Rank 0 makes the NVSHMEM unique id; every rank returns the same one (needs no GPU)."""
    import nvshmem.core as nv
    import numpy as np
    uid = nv.get_unique_id(empty=host.rank != 0)
    raw = uid._data.view(np.int8)  # a view: writing it fills the id
    data = host.broadcast_bytes(raw.tobytes() if host.rank == 0 else None, root=0)
    raw[...] = np.frombuffer(data, dtype=np.int8).reshape(raw.shape)
    return uid


def _agree_gpu(host: HostCollectives) -> int:
    """All ranks learn whether every rank has a GPU; otherwise all raise the same error (nobody hangs in init)."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    counts = host.allgather(count)
    missing = [r for r, c in enumerate(counts) if c == 0]
    if missing:
        raise NoGPUError(f"no CUDA device visible on rank(s) {missing} (torch.cuda.is_available() is False): "
                         "flux_shmem needs an NVIDIA GPU per process; run on a GPU machine (several ranks may "
                         "share one GPU)")
    return count


def init(comm=None, *, group=None, device: int | None = None, heap_size: int | None = None,
         timeout_s: float | None = None, force_put: bool | None = None) -> Runtime:
    """Start NVSHMEM on every rank. Collective.

    comm:      an mpi4py communicator to bootstrap over (default under mpirun / flux-launch: MPI.COMM_WORLD).
    group:     a torch.distributed process group instead (default under torchrun: the default group, initialised
               here with 'cpu:gloo,cuda:nccl' if nobody has). FLUX_SHMEM_BOOTSTRAP=mpi|torch overrides detection.
    device:    CUDA device index (default: local rank modulo the visible GPUs, so ranks may share a GPU).
    heap_size: bytes of symmetric heap per PE (sets NVSHMEM_SYMMETRIC_SIZE; default NVSHMEM's 1 GiB).
    timeout_s: device-side waits on peers give up after this (default $FLUX_SHMEM_TIMEOUT_S or 600).
    force_put: send every peer's data with NVSHMEM put/signal, the inter-node code path, even inside a node
               (default $FLUX_SHMEM_FORCE_PUT).
    """
    with LOCK:
        if is_initialized():
            raise FluxShmemError("flux_shmem.init() was already called in this process: use "
                                 "flux_shmem.get_runtime(), or call flux_shmem.finalize() before init() again")
        host = host_collectives(comm, group)
        layout, hosts = discover_layout(host)
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

        partition_mode = partition.mode_from_env()
        uid = broadcast_unique_id(host)
        gpus = _agree_gpu(host)
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
            raise FluxShmemError(f"NVSHMEM PE {nv.my_pe()}/{nv.n_pes()} does not match {host.name} rank "
                                 f"{layout.rank}/{layout.world_size}")
        here = (layout.node, dev_index)
        sharing = [pe for pe, key in enumerate(host.allgather(here)) if tuple(key) == here]
        if partition_mode == "green":
            # PE i of the k on this GPU runs on group i of k equal groups of its SMs (runtime/partition.py)
            partition.create(dev_index, sharing.index(layout.rank), len(sharing))
        rt = Runtime(host=host, layout=layout, device=dev_index, node_size=1, reachable=(), force_put=force_put,
                     timeout_s=timeout_s, trap_on_timeout=on_timeout == "trap",
                     shares_gpu=layout.local_size > gpus)
        set_runtime(rt)
        try:
            _finish_init(rt, hosts)
        except BaseException:
            set_runtime(None)
            raise
        return rt


def _finish_init(rt: Runtime, hosts: list[str]) -> None:
    """Error reporting, the runtime's barrier, and who reaches whom (needs a symmetric allocation)."""
    import nvshmem.bindings as nvb
    rt._internal["errors"] = signals.ErrorChannel(rt)
    stall.start(rt.rank, rt.device)  # FLUX_SHMEM_STALL_REPORT_S: report what a stuck call waits for
    sync = signals.SyncState(rt)  # symmetric: probes reachability too
    rt._internal["barrier"] = sync
    base = sync.bar.data_ptr()
    rt.reachable = tuple(bool(nvb.ptr(base, pe)) for pe in range(rt.world_size))
    matrix = rt.host.allgather(rt.reachable)
    override = os.environ.get("FLUX_SHMEM_NODE_SIZE")
    rt.node_size = kernel_node_size(hosts, matrix, force_put=rt.force_put,
                                    override=int(override) if override else None)


def finalize() -> None:
    """Free flux_shmem's symmetric memory and stop NVSHMEM. Collective; `init()` may be called again after."""
    with LOCK:
        if not is_initialized():
            return
        rt = get_runtime()
        import torch
        import nvshmem.core as nv
        from ..kernels import module
        torch.cuda.synchronize()
        errors = rt._internal.get("errors")
        if errors is not None:
            errors.close()
        module.load.cache_clear()
        rt._internal.clear()
        symmetric._free_all()
        partition.release(rt.device)
        nv.finalize()
        set_runtime(None)


@contextlib.contextmanager
def session(comm=None, **kwargs) -> Iterator[Runtime]:
    """`with flux_shmem.session() as rt:` — init on entry (same arguments), finalize on exit (also on errors)."""
    rt = init(comm, **kwargs)
    try:
        yield rt
    finally:
        try:
            finalize()
        except Exception as e:  # do not mask the body's exception
            print(f"flux_shmem: finalize failed: {e}", file=sys.stderr)
