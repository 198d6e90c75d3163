"""Baselines measured next to our fused ops (GPU only; import lazily).

(a) serial: one NCCL collective and one cuBLAS GEMM (``torch.matmul``) on the
    current stream.
(b) chunked: the same decomposed into per-rank chunks on two streams
    (AG+GEMM: rank i's shard is broadcast on a communication stream while the
    compute stream multiplies the chunks already here, local shard first;
    GEMM+RS: chunk i = the rows that end up on rank i is multiplied on the
    compute stream, then reduced to rank i on the communication stream while
    chunk i+1 is multiplied).
(c) torch SymmetricMemory fused ops (``torch.ops.symm_mem.*``), when present.

The torch.distributed NCCL process group is set up from MPI: rank 0 picks
MASTER_ADDR (its hostname, unless MASTER_ADDR is already set) and a free port
and broadcasts them with mpi4py.
"""
from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

__all__ = [
    "Unavailable",
    "NcclCollectives",
    "HostCollectives",
    "gpus_shared",
    "init_torch_distributed",
    "device_barrier",
    "nccl_all_gather",
    "nccl_reduce_scatter",
    "serial_ag_gemm",
    "ChunkedAGGemm",
    "ChunkedGemmRS",
    "symm_mem_ag_gemm",
    "symm_mem_gemm_rs",
]


class Unavailable(RuntimeError):
    """A baseline that the installed software cannot provide."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_torch_distributed(comm, rank: int, world: int, device_index: int, timeout_s: int = 900):
    """NCCL process group over the MPI ranks; returns the WORLD group."""
    if dist.is_initialized():
        return dist.group.WORLD
    addr_port = None
    if comm.Get_rank() == 0:
        addr_port = (os.environ.get("MASTER_ADDR") or socket.gethostname(), _free_port())
    addr, port = comm.bcast(addr_port, root=0)
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    kwargs = dict(backend="nccl", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                  timeout=timedelta(seconds=timeout_s))
    try:
        dist.init_process_group(device_id=device, **kwargs)
    except TypeError:  # older torch without device_id
        dist.init_process_group(**kwargs)
    return dist.group.WORLD


def device_barrier(device) -> Callable[[], None]:
    """A one-element all-reduce enqueued on the current stream: lines ranks up on the device."""
    flag = torch.zeros(1, device=device, dtype=torch.float32)

    def sync() -> None:
        dist.all_reduce(flag)

    return sync


class NcclCollectives:
    """Set-up / reference collectives through the NCCL process group (exact data movement)."""

    name = "nccl"

    def __init__(self, device):
        self._sync = device_barrier(device)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        dist.all_gather_into_tensor(out, x)
        return out

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM)
        return out

    def sync(self) -> None:
        self._sync()


class HostCollectives:
    """The same through MPI and host memory, when NCCL cannot run (several ranks on one GPU).

    Slow; used only to build inputs and references and to line ranks up
    (``sync`` synchronises the device and does an MPI barrier).
    """

    name = "mpi (host)"

    def __init__(self, comm):
        self.comm = comm

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        itemsize = x.element_size()
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
        send = x.contiguous().view(as_int).cpu().numpy()
        recv = np.empty((self.comm.Get_size(),) + send.shape, dtype=send.dtype)
        self.comm.Allgather(send, recv)  # bit-exact copy
        out.view(as_int).copy_(torch.from_numpy(recv).reshape(out.shape))
        return out

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        import numpy as np
        from mpi4py import MPI

        send = x.contiguous().to(torch.float64).cpu().numpy()
        recv = np.empty(out.shape, dtype=np.float64)
        self.comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
        out.copy_(torch.from_numpy(recv))
        return out

    def sync(self) -> None:
        torch.cuda.synchronize()
        self.comm.Barrier()


def gpus_shared(comm) -> bool:
    """True when two ranks drive the same GPU (NCCL refuses that)."""
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    key = str(getattr(props, "uuid", "")) or f"{socket.gethostname()}:{dev}"
    keys = comm.allgather(key)
    return len(set(keys)) < len(keys)


# ----------------------------------------------------------------------------- collectives alone


def nccl_all_gather(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    dist.all_gather_into_tensor(out, x)
    return out


def nccl_reduce_scatter(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM)
    return out


# ----------------------------------------------------------------------------- (a) serial


def serial_ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, gather_buf: torch.Tensor) -> torch.Tensor:
    dist.all_gather_into_tensor(gather_buf, a_shard)
    return torch.matmul(gather_buf, b)


# ----------------------------------------------------------------------------- (b) chunked, 2 streams


class ChunkedAGGemm:
    """out[M, n] = all_gather(a_shard) @ b, one broadcast per rank's shard overlapped with GEMMs."""

    def __init__(self, m: int, n: int, k: int, dtype, device, rank: int, world: int):
        if m % world:
            raise ValueError(f"M={m} not divisible by world={world}")
        self.rank, self.world, self.rows = rank, world, m // world
        self.recv = torch.empty(world, self.rows, k, dtype=dtype, device=device)
        self.out = torch.empty(m, n, dtype=dtype, device=device)
        self.comm_stream = torch.cuda.Stream(device=device)
        self.events = [torch.cuda.Event() for _ in range(world)]

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cur = torch.cuda.current_stream()
        r, w, rows = self.rank, self.world, self.rows
        self.comm_stream.wait_stream(cur)  # inputs ready, previous use of recv/out done
        with torch.cuda.stream(self.comm_stream):
            for i in range(w):
                if i == r:
                    dist.broadcast(a_shard, src=i)
                else:
                    dist.broadcast(self.recv[i], src=i)
                self.events[i].record(self.comm_stream)
        torch.matmul(a_shard, b, out=self.out[r * rows:(r + 1) * rows])
        for i in range(w):
            if i == r:
                continue
            cur.wait_event(self.events[i])
            torch.matmul(self.recv[i], b, out=self.out[i * rows:(i + 1) * rows])
        cur.wait_stream(self.comm_stream)
        return self.out


class ChunkedGemmRS:
    """out[M/world, n] = reduce_scatter(a @ b): GEMM of rank i's rows, then NCCL reduce to rank i."""

    def __init__(self, m: int, n: int, dtype, device, rank: int, world: int):
        if m % world:
            raise ValueError(f"M={m} not divisible by world={world}")
        self.rank, self.world, self.rows = rank, world, m // world
        self.c = torch.empty(m, n, dtype=dtype, device=device)
        self.comm_stream = torch.cuda.Stream(device=device)
        self.events = [torch.cuda.Event() for _ in range(world)]

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cur = torch.cuda.current_stream()
        w, rows = self.world, self.rows
        cur.wait_stream(self.comm_stream)  # previous call's reduces have read self.c
        for i in range(w):
            chunk = self.c[i * rows:(i + 1) * rows]
            torch.matmul(a[i * rows:(i + 1) * rows], b, out=chunk)
            self.events[i].record(cur)
            with torch.cuda.stream(self.comm_stream):
                self.comm_stream.wait_event(self.events[i])
                if w > 1:
                    dist.reduce(chunk, dst=i, op=dist.ReduceOp.SUM)
        cur.wait_stream(self.comm_stream)
        return self.c[self.rank * rows:(self.rank + 1) * rows]


# ----------------------------------------------------------------------------- (c) torch symm_mem


def _symm_mem_setup(group) -> str:
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the torch build
        raise Unavailable(f"torch.distributed._symmetric_memory not importable: {e}") from e
    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # required before torch 2.8, a deprecated no-op-ish call after
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(name)
    return name


def _symm_op(opname: str):
    ns = getattr(torch.ops, "symm_mem", None)
    try:
        return getattr(ns, opname)
    except (AttributeError, RuntimeError) as e:
        raise Unavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.{opname}") from e


def symm_mem_ag_gemm(group) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    name = _symm_mem_setup(group)  # importing the module registers the ops
    op = _symm_op("fused_all_gather_matmul")
    try:
        has_return_a = "return_A" in str(op.default._schema)
    except Exception:
        has_return_a = False

    def fn(a_shard: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if has_return_a:
            _, outs = op(a_shard, [b], 0, name, return_A=False)
        else:
            _, outs = op(a_shard, [b], 0, name)
        return outs[0]

    return fn


def symm_mem_gemm_rs(group) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    name = _symm_mem_setup(group)
    op = _symm_op("fused_matmul_reduce_scatter")

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return op(a, b, "sum", 0, name)

    return fn
