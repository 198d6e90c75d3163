"""The process's runtime state: what this PE is in the job (`Runtime`), set by `init()`, read by everything else.

Imports nothing of the runtime but the layout and the host-collective interface, so symmetric.py, signals.py
and the ops read the state without importing the bootstrap (imports go downward only:
topology/host/state <- symmetric <- signals <- bootstrap).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

from ..errors import NotInitializedError
from .host import HostCollectives
from .topology import Layout


@dataclasses.dataclass
class Runtime:
    """What this process is in the job. Returned by `init()`; `get_runtime()` gives it back."""

    host: HostCollectives             # host-side collectives over the job's PEs (MPI or torch.distributed)
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

    @property
    def launcher(self) -> str:
        """'mpi' (mpirun, flux-launch) or 'torch' (torchrun, a torch.distributed group)."""
        return self.host.name

    @property
    def comm(self) -> Any:
        """The mpi4py communicator or torch.distributed group the runtime was bootstrapped over."""
        return getattr(self.host, "comm", None) or getattr(self.host, "group", None)

    def is_reachable(self, pe: int) -> bool:
        """True when `pe`'s symmetric memory is mapped here (same NVLink domain): `peer()` views work."""
        if not 0 <= pe < self.world_size:
            raise ValueError(f"PE {pe} outside world of {self.world_size}")
        return self.reachable[pe]


_STATE: Runtime | None = None
LOCK = threading.Lock()  # held by init() and finalize()


def is_initialized() -> bool:
    return _STATE is not None


def get_runtime() -> Runtime:
    if _STATE is None:
        raise NotInitializedError("flux_shmem is not initialised: call flux_shmem.init() first (every rank, "
                                  "under mpirun / flux-launch or torchrun)")
    return _STATE


def set_runtime(rt: Runtime | None) -> None:
    """Install (or, with None, clear) the process's runtime. Only init() and finalize() call this."""
    global _STATE
    _STATE = rt
