"""The GPU side of the sweep: builds inputs, runs every implementation, checks and times it.

GPU only; ``run.py`` imports this after it has made sure a CUDA device is
visible.  Every rank runs the same sequence of collectives; whether an
implementation is usable is agreed across ranks (MPI) before it is called,
so a failure on one rank marks it failed everywhere instead of hanging.
"""
from __future__ import annotations

import math
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import baselines, metrics, timing
from .shapes import Problem, rotation_sets

# Relative error bounds (Frobenius norm, against an fp32 torch reference).
TOL = {"ag_gemm": 1e-2, "gemm_rs": 2e-2, "all_gather": 0.0, "reduce_scatter": 2e-2}
STAGE_ITERS = 10  # calls of a fused op timed stage by stage (after its timed iterations)
HOST_SYNC_LEAD_US = 1000.0  # > the host path of any call measured (about 0.3-0.5 ms on the H200 machine)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _status_for(e: BaseException) -> str:
    if isinstance(e, baselines.Unavailable):
        return "unavailable: " + (str(e).strip().splitlines() or ["(no reason given)"])[0]
    if isinstance(e, ( AttributeError, NotImplementedError, ImportError)):
        return "unavailable: " + _reason(e)
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "error: out of GPU memory"
    return "error: " + _reason(e)


class Suite:
    def __init__(self, *, comm, rank: int, world: int, local_rank: int, flux, flux_error: Optional[str],
                 dtype: str, iters: int, warmup: int, rotate: Optional[int], seed: int = 1234,
                 verbose: bool = False, nccl_error: Optional[str] = None, rounds: int = 5,
                 op_options: Optional[Dict[str, dict]] = None, mode: str = "auto"):
        self.comm = comm
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.flux = flux
        self.flux_error = flux_error
        self.dtype_name = dtype
        self.dtype = TORCH_DTYPES[dtype]
        # fp8: e4m3 operands with per-tensor fp32 scales, bf16 outputs; the collectives move bf16
        self.fp8 = dtype == "fp8"
        self.comm_dtype = torch.bfloat16 if self.fp8 else self.dtype
        self.iters, self.warmup, self.rotate = iters, warmup, rotate
        self.rounds = rounds
        self.op_options = op_options or {}  # extra constructor keywords per op class, e.g. AllGatherGEMM engine
        self.mode = mode  # our fused ops' mode ('auto' or 'fused'); a 'decomposed' twin is measured beside
        self._pending: List[tuple] = []
        self.seed = seed
        self.verbose = verbose
        self.device = torch.device("cuda", local_rank)
        # NCCL (and so every torch baseline) needs one GPU per rank; without it, set-up and references go
        # through MPI on the host and only our ops are timed.
        self.nccl_error = nccl_error
        self.group = dist.group.WORLD if nccl_error is None else None
        self.coll = baselines.NcclCollectives(self.device) if nccl_error is None else baselines.HostCollectives(comm)
        self.sync = self.coll.sync
        # A host-side sync leaves the GPU idle until the host has launched the timed call: a GPU lead covers our
        # host path (benchmarks/timing.py), so every implementation is timed on the device alike.
        self.lead_us = HOST_SYNC_LEAD_US if isinstance(self.coll, baselines.HostCollectives) else 0.0
        self.l2 = timing.l2_cache_bytes(self.device)
        self._ops: Dict[tuple, object] = {}
        self._max_rows: Dict[tuple, int] = {}
        self._comm_cache: Dict[tuple, Dict[str, dict]] = {}
        self._counter = 0
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references are real fp32
        torch.backends.cudnn.allow_tf32 = False

    # ------------------------------------------------------------------ helpers

    def plan(self, problems: Sequence[Problem]) -> None:
        """Record the largest M per op configuration so each op object is built once."""
        for p in problems:
            for key, rows in self._op_keys(p):
                self._max_rows[key] = max(self._max_rows.get(key, 0), rows)

    def _op_keys(self, p: Problem) -> List[Tuple[tuple, int]]:
        keys = []
        if p.op == "ag_gemm":
            keys += [(("AllGatherGEMM", p.n_local, p.k, mode), p.m) for mode in (self.mode, "decomposed")]
        if p.op == "gemm_rs":
            keys += [(("GEMMReduceScatter", p.n, p.k_local, mode), p.m) for mode in (self.mode, "decomposed")]
        if p.op in ("ag_gemm", "all_gather"):
            keys.append((("AllGather", p.k), p.m_local))
        if p.op in ("gemm_rs", "reduce_scatter"):
            keys.append((("ReduceScatter", p.n), p.m))
        return keys

    def _our_op(self, kind: str, *dims, mode: Optional[str] = None):
        if self.flux is None:
            raise baselines.Unavailable(self.flux_error or "flux_shmem not available")
        key = (kind, *dims) + ((mode,) if mode else ())
        if key not in self._ops:
            cls = getattr(self.flux, kind)  # AttributeError -> unavailable
            max_rows = self._max_rows.get(key)
            if max_rows is None:
                raise RuntimeError(f"internal: no plan for {key}")
            kw = dict(self.op_options.get(kind, {}))
            if mode:
                kw["mode"] = mode
            dtype = self.comm_dtype if kind in ("AllGather", "ReduceScatter") else self.dtype
            self._ops[key] = cls(max_rows, *dims, dtype, **kw)
        return self._ops[key]

    def _nccl(self, make: Callable[[], Callable]) -> Callable[[], Callable]:
        """Wrap the constructor of a torch.distributed baseline: unavailable without NCCL."""
        def wrapped():
            if self.nccl_error is not None:
                raise baselines.Unavailable(self.nccl_error)
            return make()
        return wrapped

    def _agree(self, status: str) -> str:
        """Same status on every rank: the first non-ok one (by rank) wins."""
        statuses = self.comm.allgather(status)
        for s in statuses:
            if s != "ok":
                return s
        return "ok"

    def _max(self, x: Optional[float]) -> Optional[float]:
        vals = self.comm.allgather(x)
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    def _gen(self) -> torch.Generator:
        self._counter += 1
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed + 7919 * self._counter + 104729 * self.rank)
        return g

    def _randn(self, shape, gen, scale: float = 1.0, dtype=None) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32)
        if scale != 1.0:
            t.mul_(scale)
        return t.to(dtype or self.dtype)

    def _fp8(self, shape, gen, scale: float = 1.0) -> tuple:
        """(e4m3 tensor, its per-tensor fp32 scale, the dequantized fp32 values) of fresh random values."""
        t = self._randn(shape, gen, scale, dtype=torch.float32)
        s = (t.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).float()
        q = (t / s).to(torch.float8_e4m3fn)
        return q, s, q.float() * s

    def _nsets(self, bytes_per_set: int) -> int:
        if self.rotate:
            n = self.rotate
        else:
            budget = int(0.3 * timing.free_bytes())
            n = rotation_sets(bytes_per_set, self.l2, budget)
        return int(self.comm.allreduce(n, op=_mpi_min()))

    def measure(self, name: str, make: Callable[[], Callable], sets: Sequence[tuple],
                check: Callable[[object], float], tol: float, stages: bool = False) -> dict:
        """Construct and check on sets[0] one implementation (same outcome on every rank); its timing follows in
        `_time_pending`, interleaved with the problem's other implementations. stages: then also time a few
        calls stage by stage (`_stage_breakdown`: when the fused GEMM ended, when the communication did)."""
        fn = None
        status = "ok"
        try:
            fn = make()
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            status = _status_for(e)
            if self.verbose:
                traceback.print_exc()
        status = self._agree(status)
        entry: dict = {"status": status, "ms": None, "rel_err": None, "tol": tol, "ok": None}
        if status != "ok":
            return entry
        err = None
        try:
            out = fn(*sets[0])
            torch.cuda.synchronize()
            err = float(check(out))
            del out
        except Exception as e:  # noqa: BLE001
            status = _status_for(e)
            if self.verbose:
                traceback.print_exc()
        status = self._agree(status)
        entry["status"] = status
        if status != "ok":
            return entry
        err = self._max(err)
        entry["rel_err"] = err if err is None or math.isfinite(err) else float("inf")
        entry["ok"] = bool(err is not None and err <= tol)
        entry["rotation_sets"] = len(sets)
        self._pending.append((entry, fn, sets, stages))  # timed by _time_pending, interleaved with the others
        return entry

    def _time_pending(self) -> None:
        """Time every implementation checked since the last call, in `rounds` rounds that alternate their order
        (forward, backward, ...), so that clock and power drift (large GEMMs hold the GPU at its power limit)
        hit all of them alike; each gets `iters` samples in all, and `warmup` runs before its first round and
        one before each later round. Fills ms (median, max over ranks), ms_min and iters."""
        pending, self._pending = self._pending, []
        rounds = max(1, min(self.rounds, self.iters))
        per_round = [self.iters // rounds + (1 if i < self.iters % rounds else 0) for i in range(rounds)]
        samples: Dict[int, List[float]] = {id(e): [] for e, _, _, _ in pending}
        for rnd, n_iters in enumerate(per_round):
            for entry, fn, sets, _ in (pending if rnd % 2 == 0 else pending[::-1]):
                if entry["status"] != "ok":
                    continue
                try:
                    samples[id(entry)] += timing.cuda_time(fn, sets, warmup=self.warmup if rnd == 0 else 1,
                                                           iters=n_iters, sync=self.sync, lead_us=self.lead_us)
                    status = "ok"
                except Exception as e:  # noqa: BLE001
                    status = _status_for(e)
                entry["status"] = self._agree(status)
        for entry, _, _, _ in pending:
            if entry["status"] == "ok":
                got = samples[id(entry)]
                entry["ms"] = self._max(metrics.median(got))  # the op is done when the slowest rank is
                entry["ms_min"] = min(v for v in self.comm.allgather(min(got)) if v is not None)
                entry["iters"] = len(got)
                entry["rounds"] = rounds
        for entry, fn, sets, stages in pending:
            if stages and entry["status"] == "ok":
                self._stage_breakdown(entry, fn, sets)

    def _stage_breakdown(self, entry: dict, fn: Callable, sets: Sequence[tuple]) -> None:
        """STAGE_ITERS calls of a fused op with its stages timed (flux_shmem.runtime.stall.timed_stages), each
        synced like a timed iteration: `stages_ms` = per stage, the median ms since the call's start (max over
        ranks), `fused_gemm_ms` = the median time its GEMM ran (max over ranks). Only figures: a failure here is
        recorded as `stages_error` and changes no status."""
        calls, gemm, err = [], [], None
        try:
            from flux_shmem.runtime import stall
            marks = []
            for i in range(STAGE_ITERS):
                self.sync()
                if self.lead_us > 0:
                    timing.gpu_sleep(self.lead_us)
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                with stall.timed_stages() as traced:
                    fn(*sets[i % len(sets)])
                marks.append((start, traced))
            torch.cuda.synchronize()
            for start, traced in marks:
                if len(traced) != 1:
                    raise RuntimeError(f"expected one traced op call per iteration, got {len(traced)}")
                st = stall.stage_offsets_ms(traced[0], start)
                calls.append(st)
                g = metrics.fused_gemm_ms(st)
                if g is not None:
                    gemm.append(g)
        except Exception as e:  # noqa: BLE001 - a breakdown is extra information, never fatal
            err = _reason(e)
        errs = [x for x in self.comm.allgather(err) if x]
        if errs:
            entry["stages_error"] = errs[0]
            return
        mine = metrics.stage_medians(calls)
        every = self.comm.allgather(mine)
        entry["stages_ms"] = {lab: max(d.get(lab, t) for d in every) for lab, t in mine.items()}
        entry["fused_gemm_ms"] = self._max(metrics.median(gemm) if gemm else None)

    # ------------------------------------------------------------------ problems

    def run(self, p: Problem) -> Dict[str, dict]:
        try:
            if p.op == "ag_gemm":
                return self._ag_gemm(p)
            if p.op == "gemm_rs":
                return self._gemm_rs(p)
            if p.op == "all_gather":
                return self._comm(p.op, p.m, p.k)
            if p.op == "reduce_scatter":
                return self._comm(p.op, p.m, p.n)
            raise ValueError(p.op)
        finally:
            self._pending = []  # a problem that failed part-way leaves nothing to time
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _comm(self, op: str, rows: int, cols: int) -> Dict[str, dict]:
        """ours vs NCCL for the collective moving a [rows, cols] tensor (cached per shape)."""
        key = (op, rows, cols)
        if key in self._comm_cache:
            return self._comm_cache[key]
        W, r = self.world, self.rank
        dt = self.comm_dtype
        es = torch.empty((), dtype=dt).element_size()
        gen = self._gen()
        tol = TOL[op]
        res: Dict[str, dict] = {}
        if op == "all_gather":
            loc = rows // W
            n = self._nsets((loc + rows) * cols * es)
            xs = [self._randn((loc, cols), gen, dtype=dt) for _ in range(n)]
            ref = torch.empty(rows, cols, dtype=dt, device=self.device)
            self.coll.all_gather(ref, xs[0])
            # sanity check of the reference itself: our shard must sit at rows [r*loc, (r+1)*loc)
            if not torch.equal(ref[r * loc:(r + 1) * loc], xs[0]):
                raise RuntimeError(f"{self.coll.name} all_gather reference is inconsistent")
            sets = [(x,) for x in xs]
            nccl_out = torch.empty(rows, cols, dtype=dt, device=self.device)
            res["ours"] = self.measure("ours", lambda: _no_copy(self._our_op("AllGather", cols)),
                                       sets,
                                       lambda out: timing.relative_error(out, ref), tol)
            res["nccl"] = self.measure("nccl", self._nccl(lambda: (lambda x: baselines.nccl_all_gather(x, nccl_out))),
                                       sets, lambda out: timing.relative_error(out, ref), tol)
        else:
            n = self._nsets(rows * cols * es + (rows // W) * cols * es)
            xs = [self._randn((rows, cols), gen, dtype=dt) for _ in range(n)]
            ref = torch.empty(rows // W, cols, dtype=torch.float32, device=self.device)
            self.coll.reduce_scatter(ref, xs[0].float())
            sets = [(x,) for x in xs]
            nccl_out = torch.empty(rows // W, cols, dtype=dt, device=self.device)
            res["ours"] = self.measure("ours", lambda: self._resident(self._our_op("ReduceScatter", cols), xs[0]),
                                       sets, lambda out: timing.relative_error(out, ref), tol)
            res["nccl"] = self.measure("nccl",
                                       self._nccl(lambda: (lambda x: baselines.nccl_reduce_scatter(x, nccl_out))),
                                       sets, lambda out: timing.relative_error(out, ref), tol)
        self._time_pending()
        self._comm_cache[key] = res
        return res

    def _ag_gemm(self, p: Problem) -> Dict[str, dict]:
        W, r = self.world, self.rank
        m, mloc, n, k = p.m, p.m_local, p.n_local, p.k
        comm = self._comm("all_gather", m, k)  # (e) and NCCL alone; first, so its buffers are gone after
        torch.cuda.empty_cache()
        es = p.elem_bytes
        gen = self._gen()
        nsets = self._nsets((mloc * k + k * n + m * k) * es)
        sets = []
        for _ in range(nsets):
            a_shard = self._randn((mloc, k), gen)
            b = self._randn((k, n), gen, scale=1.0 / math.sqrt(k))
            a_full = torch.empty(m, k, dtype=self.dtype, device=self.device)
            self.coll.all_gather(a_full, a_shard)
            sets.append((a_shard, b, a_full))
        a_shard0, b0, a_full0 = sets[0]
        ref = a_full0.float() @ b0.float()
        tol = TOL["ag_gemm"]

        def chk(out):
            return timing.relative_error(out, ref)

        res: Dict[str, dict] = {"ours_comm": dict(comm["ours"]), "nccl": dict(comm["nccl"])}
        res["ours"] = self.measure(
            "ours", lambda: (lambda op: (lambda a_s, b, a_f: op(a_s, b)))(self._our_op("AllGatherGEMM", n, k, mode=self.mode)),
            sets, chk, tol, stages=True)
        self._describe(res["ours"], "AllGatherGEMM", n, k, m)
        res["decomposed"] = self.measure(
            "decomposed",
            lambda: (lambda op: (lambda a_s, b, a_f: op(a_s, b)))(self._our_op("AllGatherGEMM", n, k, mode="decomposed")),
            sets, chk, tol)
        res["ours_gemm_split"] = self.measure(
            "ours_gemm_split", lambda: self._gemm_split("AllGatherGEMM", n, k, m, lambda op, s, a_s, b, a_f:
                                                        op.gemm_only(a_f, b, sm_count=s)),
            sets, chk, tol)

        def make_chunked():
            c = baselines.ChunkedAGGemm(m, n, k, self.dtype, self.device, r, W)
            return lambda a_s, b, a_f: c(a_s, b)

        res["chunked"] = self.measure("chunked", self._nccl(make_chunked), sets, chk, tol)

        def make_symm():
            f = baselines.symm_mem_ag_gemm(self.group)
            return lambda a_s, b, a_f: f(a_s, b)

        res["symm_mem"] = self.measure("symm_mem", self._nccl(make_symm), sets, chk, tol)
        gather_buf = torch.empty(m, k, dtype=self.dtype, device=self.device)
        res["serial"] = self.measure(
            "serial", self._nccl(lambda: (lambda a_s, b, a_f: baselines.serial_ag_gemm(a_s, b, gather_buf))),
            sets, chk, tol)
        res["ours_gemm"] = self.measure(
            "ours_gemm",
            lambda: (lambda op: (lambda a_s, b, a_f: op.gemm_only(a_f, b)))(self._our_op("AllGatherGEMM", n, k, mode=self.mode)),
            sets, chk, tol)
        res["cublas"] = self.measure("cublas", lambda: (lambda a_s, b, a_f: torch.matmul(a_f, b)), sets, chk, tol)
        self._time_pending()
        return res

    def _gemm_rs(self, p: Problem) -> Dict[str, dict]:
        W, r = self.world, self.rank
        m, n, kloc = p.m, p.n, p.k_local
        comm = self._comm("reduce_scatter", m, n)
        torch.cuda.empty_cache()
        es = p.elem_bytes
        gen = self._gen()
        nsets = self._nsets((m * kloc + kloc * n) * es)
        sets = []
        if self.fp8:  # (a, b = w.t(), scale_a, scale_b), per-tensor scales; the baselines are torch._scaled_mm
            for i in range(nsets):
                a, sa, a_deq = self._fp8((m, kloc), gen)
                w, sb, w_deq = self._fp8((n, kloc), gen, scale=1.0 / math.sqrt(p.k))
                sets.append((a, w.t(), sa, sb))
                if i == 0:
                    partial = a_deq @ w_deq.t()
                del a_deq, w_deq
        else:
            for _ in range(nsets):
                a = self._randn((m, kloc), gen)
                b = self._randn((kloc, n), gen, scale=1.0 / math.sqrt(p.k))
                sets.append((a, b))
            a0, b0 = sets[0]
            partial = a0.float() @ b0.float()
        ref = torch.empty(m // W, n, dtype=torch.float32, device=self.device)
        self.coll.reduce_scatter(ref, partial)
        tol = TOL["gemm_rs"]

        def chk(out):
            return timing.relative_error(out, ref)

        def chk_partial(out):
            return timing.relative_error(out, partial)

        res: Dict[str, dict] = {"ours_comm": dict(comm["ours"]), "nccl": dict(comm["nccl"])}

        def sc(*s) -> dict:  # an fp8 set's scales as keywords
            return dict(scale_a=s[0], scale_b=s[1]) if s else {}

        def mm(a, b, *s):  # the torch GEMM of a set (cuBLAS; cuBLASLt fp8 via torch._scaled_mm)
            if s:
                return torch._scaled_mm(a, b, s[0], s[1], out_dtype=torch.bfloat16)
            return torch.matmul(a, b)

        def not_fp8(make):
            def wrapped():
                if self.fp8:
                    raise baselines.Unavailable("no fp8 variant of this baseline")
                return make()
            return wrapped
        res["ours"] = self.measure(
            "ours", lambda: (lambda op: (lambda a, b, *s: op(a, b, **sc(*s))))(
                self._our_op("GEMMReduceScatter", n, kloc, mode=self.mode)),
            sets, chk, tol, stages=True)
        self._describe(res["ours"], "GEMMReduceScatter", n, kloc, m)
        res["decomposed"] = self.measure(
            "decomposed", lambda: (lambda op: (lambda a, b, *s: op(a, b, **sc(*s))))(
                self._our_op("GEMMReduceScatter", n, kloc, mode="decomposed")),
            sets, chk, tol)
        res["ours_gemm_split"] = self.measure(
            "ours_gemm_split", lambda: self._gemm_split(
                "GEMMReduceScatter", n, kloc, m, lambda op, sms, a, b, *s: op.gemm_only(a, b, sm_count=sms, **sc(*s))),
            sets, chk_partial, tol)
        if self.mode == "fused" and W > 1:
            res["ours_fused_gemm_alone"] = self.measure(
                "ours_fused_gemm_alone",
                lambda: (lambda op: (lambda a, b, *s: op.fused_gemm_alone(a, b, **sc(*s))))(
                    self._our_op("GEMMReduceScatter", n, kloc, mode=self.mode)),
                sets, chk_partial, tol)

        def make_chunked():
            c = baselines.ChunkedGemmRS(m, n, self.dtype, self.device, r, W)
            return lambda a, b: c(a, b)

        res["chunked"] = self.measure("chunked", self._nccl(not_fp8(make_chunked)), sets, chk, tol)
        res["symm_mem"] = self.measure("symm_mem", self._nccl(not_fp8(lambda: baselines.symm_mem_gemm_rs(self.group))),
                                       sets, chk, tol)
        out_buf = torch.empty(m // W, n, dtype=self.comm_dtype, device=self.device)
        res["serial"] = self.measure(
            "serial", self._nccl(lambda: (lambda *st: baselines.nccl_reduce_scatter(mm(*st), out_buf))),
            sets, chk, tol)
        res["ours_gemm"] = self.measure(
            "ours_gemm", lambda: (lambda op: (lambda a, b, *s: op.gemm_only(a, b, **sc(*s))))(
                self._our_op("GEMMReduceScatter", n, kloc, mode=self.mode)),
            sets, chk_partial, tol)
        res["cublas"] = self.measure("cublas", lambda: mm, sets, chk_partial, tol)
        self._time_pending()
        return res

    @staticmethod
    def _resident(rs, x):
        """Our reduce-scatter with its input already in the symmetric buffer (as GEMM+RS's GEMM leaves it), so the
        timing is the communication alone, not also a copy of the input: every call reduces x."""
        buf = rs.input_buffer(x.shape[0])
        buf.copy_(x)
        return lambda _x: rs(buf)

    def _describe(self, entry: dict, kind: str, n: int, k: int, m: int) -> None:
        """Record how our fused op ran (path, engine, SM split, the simulator's prediction)."""
        if entry.get("status") == "ok":
            plan = self._our_op(kind, n, k, mode=self.mode).call_plan(m)
            entry["plan"] = plan.describe()
            entry["path"], entry["engine"] = plan.path, plan.engine
            entry["comm_blocks"], entry["gemm_sms"] = plan.comm_blocks, plan.gemm_sms

    def _gemm_split(self, kind: str, n: int, k: int, m: int, call: Callable) -> Callable:
        """gemm_only on as many CTAs as the fused call's GEMM gets (the same SM budget)."""
        op = self._our_op(kind, n, k, mode=self.mode)
        sms = op.call_plan(m).gemm_sms
        return lambda *a: call(op, sms, *a)

    def close(self) -> None:
        self._ops.clear()
        self._comm_cache.clear()
        torch.cuda.synchronize()


def _no_copy(op) -> Callable:
    """``op(x, copy=False)`` where the op offers it (returns its internal buffer, like NCCL writing into a
    preallocated output), else ``op(x)``."""
    import inspect

    try:
        takes_copy = "copy" in inspect.signature(op.__call__).parameters
    except (TypeError, ValueError):
        takes_copy = False
    if takes_copy:
        return lambda x: op(x, copy=False)
    return op


def _mpi_min():
    from mpi4py import MPI

    return MPI.MIN
