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
    _fields_ = [("ctx", Ctx), ("sig", c_ptr), ("expected", c_u64), ("site", c_i32), ("index", c_i32)]


class WaitFlagsArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("flags", c_ptr), ("target", c_ptr), ("first", c_i32), ("stride", c_i32),
                ("count", c_i32), ("site", c_i32)]


class Pace(ctypes.Structure):
    """Link emulation (csrc/include/flux_shmem/pace.cuh): clock null or fs_per_byte 0 = not paced."""
    _fields_ = [("clock", c_ptr), ("fs_per_byte", ctypes.c_uint32 * 2), ("latency_ns", ctypes.c_uint32 * 2)]


class WaitDoneArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("done", c_ptr), ("epoch", c_ptr), ("node_size", c_i32), ("pad_", c_i32)]


class AgArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("src", c_ptr), ("gather", c_ptr), ("flags", c_ptr), ("recv", c_ptr), ("bar", c_ptr),
                ("epoch", c_ptr), ("units", c_ptr), ("block_begin", c_ptr), ("started", c_ptr), ("shard_bytes", c_u64),
                ("chunk_bytes", c_u64), ("chunks", c_i32), ("node_size", c_i32), ("wait_all", c_i32),
                ("pad_", c_i32), ("pace", Pace)]


class RsArgs(ctypes.Structure):
    _fields_ = [("ctx", Ctx), ("src", c_ptr), ("partial", c_ptr), ("stage", c_ptr), ("recv", c_ptr),
                ("recv_sig", c_ptr), ("out", c_ptr), ("bias", c_ptr), ("tile_ready", c_ptr),
                ("seen", c_ptr), ("bar", c_ptr), ("done", c_ptr), ("exits", c_ptr), ("epoch", c_ptr),
                ("items", c_ptr), ("block_begin", c_ptr), ("m", c_i64), ("n", c_i64), ("rows_per_shard", c_i64),
                ("tile_m", c_i32), ("tile_n", c_i32), ("tiles_n", c_i32), ("group_tiles", c_i32),
                ("unit_rows", c_i32), ("node_size", c_i32), ("max_tiles_m", c_i32), ("max_units", c_i32),
                ("flags", c_i32), ("pad_", c_i32), ("pace", Pace)]


RS_SIGNAL_DONE = 2  # RsArgs.flags (csrc/collectives.cu)
RS_EVICT_FIRST = 4
RS_POLL_SLEEP = 8


# Error sites (fs::Site) for messages, and a hint at the usual cause.
SITES = {1: "barrier arrival slot of PE", 2: "all-gather chunk flag (source PE * chunks + chunk)",
         3: "GEMM tile-ready word (PE * tiles + M-tile * N-tiles + N-tile)",
         4: "reduce-scatter receive signal (node * units + unit)",
         5: "reduce-scatter done slot of PE",
         6: "all-gather start gate (the blocks of this PE's gather kernel that have started)",
         7: "GEMM split-K lock (reduction slot * consumer warpgroups + warpgroup)", 9: "test signal"}
HINTS = {7: " A split of that tile never arrived: a CTA of the GEMM's grid may never have become resident, or another "
            "launch overwrote this GEMM's workspace (one instance's workspace serves one launch at a time).",
         6: " The gather kernel's blocks could not all become resident: another kernel holds the SMs of this "
            "context (see FLUX_SHMEM_SMS, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, FLUX_SHMEM_SM_PARTITION).",
         2: " If the all-gather kernel of the source PE never ran, another kernel may hold the SMs it needs (the "
            "fused GEMM leaves comm_blocks SMs free of the context's budget): run fewer concurrent kernels, or use "
            "engine='ce'.",
         3: " If the GEMM of that PE never finished its tiles, check that every PE called the op the same number "
            "of times with the same M."}
