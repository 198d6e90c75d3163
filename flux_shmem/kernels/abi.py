"""ctypes mirrors of the C structs that kernels take by value (csrc/include/flux_shmem/signal.cuh,
csrc/collectives.cu). `Kernel.launch` checks each against the size the cubin declares."""
from __future__ import annotations

import ctypes

c_u64, c_i64, c_i32, c_ptr = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class ErrorRecord(ctypes.Structure):
    _fields_ = [("flag", c_u64), ("expected", c_u64), ("seen", c_u64), ("addr", c_u64), ("code", c_i32),
                ("pe", c_i32), ("site", c_i32), ("index", c_i32), ("block", c_i32), ("thread", c_i32)]


class ErrorSlot(ctypes.Structure):
    _fields_ = [("claim", c_u64), ("record", c_ptr)]


class Ctx(ctypes.Structure):
    _fields_ = [("err", c_ptr), ("timeout_ns", c_u64), ("my_pe", c_i32), ("n_pes", c_i32),
                ("trap_on_timeout", c_i32), ("pad_", c_i32)]


class EpochArgs(ctypes.Structure):
    _fields_ = [("epoch", c_ptr)]


class BarrierArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("bar", c_ptr), ("epoch", c_ptr), ("node_size", c_i32), ("pad_", c_i32)]


class WaitArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("sig", c_ptr), ("expected", c_u64)]


class AgArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("src", c_ptr), ("gather", c_ptr), ("flags", c_ptr), ("bar", c_ptr),
                ("epoch", c_ptr), ("shard_bytes", c_u64), ("chunk_bytes", c_u64), ("chunks", c_i32),
                ("node_size", c_i32), ("wait_all", c_i32), ("pad_", c_i32)]


class RsArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("src", c_ptr), ("partial", c_ptr), ("stage", c_ptr), ("recv", c_ptr), ("recv_sig", c_ptr),
                ("out", c_ptr), ("bias", c_ptr), ("rows_ready", c_ptr), ("bar", c_ptr), ("epoch", c_ptr),
                ("m", c_i64), ("n", c_i64), ("rows_per_shard", c_i64), ("tile_m", c_i32), ("tiles_n", c_i32),
                ("unit_rows", c_i32), ("node_size", c_i32), ("max_tiles_m", c_i32), ("pad_", c_i32)]


# Error sites (fs::Site) for messages.
SITES = {1: "barrier arrival slot of PE", 2: "all-gather chunk flag (source PE * chunks + chunk)",
         3: "GEMM rows-ready counter of M-tile", 4: "reduce-scatter receive signal (node * units + unit)",
         9: "test signal"}
