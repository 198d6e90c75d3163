"""Link emulation: pace every peer transfer of the comm engines to a given bandwidth and latency.

With several PEs on one GPU (CUDA MPS), a transfer to a "peer" is a copy inside one GPU's memory, many times
faster than NVLink or InfiniBand, so overlap measured there says nothing. Set

    FLUX_SHMEM_LINK_GBPS=B  [FLUX_SHMEM_LINK_LATENCY_US=x]       every peer transfer (default latency 1.5 us)
    FLUX_SHMEM_IB_GBPS=B    [FLUX_SHMEM_IB_LATENCY_US=x]         transfers between nodes (default: the LINK values)

and each PE's transfers over a link class run at most at B GB/s, back to back (csrc/include/flux_shmem/pace.cuh).
The copy engines cannot be paced: engine='ce' refuses emulation.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

from ..kernels import abi


@dataclasses.dataclass(frozen=True)
class LinkEmulation:
    gbps: float
    latency_us: float
    ib_gbps: float
    ib_latency_us: float

    def describe(self) -> str:
        s = f"emulated links {self.gbps:g} GB/s + {self.latency_us:g} us"
        if (self.ib_gbps, self.ib_latency_us) != (self.gbps, self.latency_us):
            s += f", between nodes {self.ib_gbps:g} GB/s + {self.ib_latency_us:g} us"
        return s


def _num(env: dict, name: str, default: Optional[float], positive: bool) -> Optional[float]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if (positive and not v > 0) or v < 0:
        raise ValueError(f"{name}={raw!r} must be {'> 0' if positive else '>= 0'}")
    return v


def emulation_from(env) -> Optional[LinkEmulation]:
    """The emulation the environment asks for, or None."""
    gbps = _num(env, "FLUX_SHMEM_LINK_GBPS", None, True)
    ib = _num(env, "FLUX_SHMEM_IB_GBPS", None, True)
    if gbps is None and ib is None:
        for name in ("FLUX_SHMEM_LINK_LATENCY_US", "FLUX_SHMEM_IB_LATENCY_US"):
            if env.get(name):
                raise ValueError(f"{name} is set without FLUX_SHMEM_LINK_GBPS: set the bandwidth too")
        return None
    if gbps is None:
        raise ValueError("FLUX_SHMEM_IB_GBPS needs FLUX_SHMEM_LINK_GBPS (the NVLink-class bandwidth) too")
    lat = _num(env, "FLUX_SHMEM_LINK_LATENCY_US", 1.5, False)
    return LinkEmulation(gbps, lat, ib if ib is not None else gbps, _num(env, "FLUX_SHMEM_IB_LATENCY_US", lat, False))


def emulation() -> Optional[LinkEmulation]:
    return emulation_from(os.environ)


def pace_struct(em: Optional[LinkEmulation], clock_ptr: int) -> abi.Pace:
    p = abi.Pace()
    if em is None:
        return p
    p.clock = clock_ptr
    for i, (gbps, lat) in enumerate(((em.gbps, em.latency_us), (em.ib_gbps, em.ib_latency_us))):
        p.fs_per_byte[i] = max(1, round(1e6 / gbps))  # femtoseconds per byte = 1e15 / (gbps * 1e9)
        p.latency_ns[i] = round(lat * 1e3)
    return p


@functools.lru_cache(maxsize=None)
def _clock(device: int):
    import torch
    return torch.zeros(2, dtype=torch.int64, device=f"cuda:{device}")  # when each link class is next free


def clock(device: int):
    """This process's link clocks, or None without emulation."""
    return _clock(device) if emulation() is not None else None


def pace(device: int) -> abi.Pace:
    """The Pace argument of this PE's comm kernels: one link clock per process, shared by all ops."""
    em = emulation()
    return pace_struct(em, _clock(device).data_ptr() if em is not None else 0)
