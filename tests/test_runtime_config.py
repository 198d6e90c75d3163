"""What the runtime reads from the machine and the environment, without a GPU: the SM budget of the context, the
link emulation settings, the default timeout."""
from __future__ import annotations

import pytest

from flux_shmem.runtime import pacing
from flux_shmem.runtime.sm_budget import budget_from


def test_sm_budget_sources_in_order():
    b = budget_from(132)
    assert (b.sms, b.device_sms, b.source) == (132, 132, "device")
    # under MPS the driver reports the client's share already (66 of 132 at 50%): not applied twice
    b = budget_from(66, mps_percentage="50")
    assert (b.sms, b.device_sms, b.share) == (66, 132, 0.5) and "MPS 50%" in b.source
    assert budget_from(34, mps_percentage="25").device_sms == 136 and budget_from(34, mps_percentage="25").sms == 34
    assert budget_from(132, affinity_sms=40).sms == 40  # a green context's SM count
    assert budget_from(132, affinity_sms=132).source == "device"  # no restriction reported
    assert budget_from(66, mps_percentage="50", physical_sms=132).share == 0.5
    assert budget_from(132, override="100", affinity_sms=40).sms == 100
    for bad in ("0", "133", "x"):
        with pytest.raises(ValueError, match="FLUX_SHMEM_SMS"):
            budget_from(132, override=bad)
    with pytest.raises(ValueError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        budget_from(132, mps_percentage="150")


def test_link_emulation_settings():
    assert pacing.emulation_from({}) is None
    em = pacing.emulation_from({"FLUX_SHMEM_LINK_GBPS": "180"})
    assert (em.gbps, em.latency_us, em.ib_gbps, em.ib_latency_us) == (180.0, 1.5, 180.0, 1.5)
    em = pacing.emulation_from({"FLUX_SHMEM_LINK_GBPS": "180", "FLUX_SHMEM_LINK_LATENCY_US": "2",
                                "FLUX_SHMEM_IB_GBPS": "20", "FLUX_SHMEM_IB_LATENCY_US": "6"})
    assert (em.gbps, em.latency_us, em.ib_gbps, em.ib_latency_us) == (180.0, 2.0, 20.0, 6.0)
    assert "between nodes 20 GB/s" in em.describe()
    for env, word in (({"FLUX_SHMEM_LINK_GBPS": "0"}, "> 0"), ({"FLUX_SHMEM_LINK_GBPS": "fast"}, "not a number"),
                      ({"FLUX_SHMEM_IB_GBPS": "20"}, "FLUX_SHMEM_LINK_GBPS"),
                      ({"FLUX_SHMEM_LINK_LATENCY_US": "2"}, "without FLUX_SHMEM_LINK_GBPS")):
        with pytest.raises(ValueError, match=word):
            pacing.emulation_from(env)
    p = pacing.pace_struct(pacing.emulation_from({"FLUX_SHMEM_LINK_GBPS": "100", "FLUX_SHMEM_IB_GBPS": "25"}), 4096)
    assert p.clock == 4096 and list(p.fs_per_byte) == [10000, 40000] and list(p.latency_ns) == [1500, 1500]
    assert pacing.pace_struct(None, 4096).clock is None


def test_default_timeout_is_minutes():
    """Ranks of a healthy multi-node job drift by minutes (kernel builds, checkpoints): 30 s killed them."""
    from flux_shmem.runtime import bootstrap
    assert bootstrap.DEFAULT_TIMEOUT_S >= 300


def test_emulate_link_presets_scale_with_the_sm_share():
    from benchmarks import run
    assert run.emulation_env("nvlink", 0.5) == {"FLUX_SHMEM_LINK_GBPS": "180.000", "FLUX_SHMEM_LINK_LATENCY_US": "1.5"}
    assert run.emulation_env("ib", 0.25)["FLUX_SHMEM_LINK_GBPS"] == "10.000"
    with pytest.raises(ValueError):
        run.emulation_env("nvlink", 0)


def test_start_event_switch(monkeypatch):
    from flux_shmem.ops._fused import start_event_enabled
    monkeypatch.delenv("FLUX_SHMEM_START_EVENT", raising=False)
    assert start_event_enabled()
    monkeypatch.setenv("FLUX_SHMEM_START_EVENT", "0")
    assert not start_event_enabled()
    monkeypatch.setenv("FLUX_SHMEM_START_EVENT", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        start_event_enabled()


def test_reduce_kernel_experiment_switches(monkeypatch):
    import torch
    from flux_shmem.kernels import abi
    from flux_shmem.ops.reduce_scatter import kernel_flags
    for name in ("FLUX_SHMEM_RS_EVICT_FIRST", "FLUX_SHMEM_RS_POLL_SLEEP"):
        monkeypatch.delenv(name, raising=False)
    assert kernel_flags(torch.bfloat16) == 0
    monkeypatch.setenv("FLUX_SHMEM_RS_EVICT_FIRST", "1")
    assert kernel_flags(torch.bfloat16) == abi.RS_EVICT_FIRST and kernel_flags(torch.float32) == 0  # 16-bit only
    monkeypatch.setenv("FLUX_SHMEM_RS_POLL_SLEEP", "1")
    assert kernel_flags(torch.float16) == abi.RS_EVICT_FIRST | abi.RS_POLL_SLEEP
    monkeypatch.setenv("FLUX_SHMEM_RS_POLL_SLEEP", "on")
    with pytest.raises(ValueError, match="FLUX_SHMEM_RS_POLL_SLEEP must be 0 or 1"):
        kernel_flags(torch.bfloat16)


def test_sm_partition_setting_and_split(monkeypatch):
    from flux_shmem.errors import FluxShmemError
    from flux_shmem.runtime import partition
    monkeypatch.delenv(partition.ENV, raising=False)
    assert partition.mode_from_env() == "none"
    monkeypatch.setenv(partition.ENV, "Green")
    assert partition.mode_from_env() == "green"
    monkeypatch.setenv(partition.ENV, "mps")
    with pytest.raises(ValueError, match="one of none, green"):
        partition.mode_from_env()
    # H200: 132 SMs, Hopper green contexts align to 8
    assert partition.group_size(132, 1) == 128
    assert partition.group_size(132, 2) == 64
    assert partition.group_size(132, 4) == 32
    assert partition.group_size(132, 16) == 8
    with pytest.raises(FluxShmemError, match="fewer PEs"):
        partition.group_size(132, 17)
    with pytest.raises(ValueError):
        partition.group_size(132, 0)
    with pytest.raises(ValueError, match="outside"):
        partition.create(0, 2, 2)


def test_sm_budget_follows_the_active_partition(monkeypatch):
    """With a green context active the budget is its group, whatever MPS or the device say."""
    from flux_shmem.runtime import partition, sm_budget as smb
    part = partition.Partition(device=5, index=1, groups=2, sms=64, device_sms=132, green_ctx=None, stream_handle=0)
    monkeypatch.setitem(partition._ACTIVE, 5, part)
    b = smb.sm_budget(5)
    assert (b.sms, b.device_sms) == (64, 132)
    assert "green context 1/2" in b.source


def test_rs_done_protocol_switch_and_its_calls(monkeypatch):
    """FLUX_SHMEM_RS_DONE=1: GEMMReduceScatter waits on its node peers' done flags instead of a barrier, and a
    call's only reduce launch signals done from its last block (RS_SIGNAL_DONE); off, the barrier, no signal."""
    from types import SimpleNamespace
    from flux_shmem.kernels import abi
    from flux_shmem.ops import reduce_scatter
    from flux_shmem.ops.gemm_rs import GEMMReduceScatter
    monkeypatch.delenv("FLUX_SHMEM_RS_DONE", raising=False)
    assert reduce_scatter.done_protocol() is False
    monkeypatch.setenv("FLUX_SHMEM_RS_DONE", "1")
    assert reduce_scatter.done_protocol() is True
    monkeypatch.setenv("FLUX_SHMEM_RS_DONE", "yes")
    with pytest.raises(ValueError, match="FLUX_SHMEM_RS_DONE must be 0 or 1"):
        reduce_scatter.done_protocol()
    calls = []
    eng = SimpleNamespace(wait_done=lambda s: calls.append(("wait_done", s)),
                          sync=SimpleNamespace(barrier=lambda s: calls.append(("barrier", s))))
    for on in (True, False):
        GEMMReduceScatter._no_reader(SimpleNamespace(done_protocol=on, engine=eng), "stream")
    assert calls == [("wait_done", "stream"), ("barrier", "stream")]
    # the launch's flags: RS_SIGNAL_DONE with a source (the standalone op) or signal_done=True, else none
    launched = []
    monkeypatch.setattr(reduce_scatter.signals, "ctx", lambda: abi.Ctx())
    fake = SimpleNamespace(
        rt=SimpleNamespace(world_size=2, node_size=2), kernel_flags=0, comm_blocks=4, unit_rows=8, tile_m=8,
        tile_n=16, tiles_n=1, cols=16, max_tiles_m=4, max_units=8, pace=abi.Pace(),
        plan=lambda *a, **k: (((_P(), _P(), 1)), None, SimpleNamespace(group_tiles=1)),
        _kernel=SimpleNamespace(launch=lambda args, *a, **k: launched.append(args.flags)),
        **{n: _P() for n in ("partial", "stage", "recv", "recv_sig", "tile_ready", "seen", "done", "exits")},
        sync=SimpleNamespace(bar=_P(), epoch=_P()))
    out = _P()
    reduce_scatter.ReduceEngine.launch(fake, 32, out, src=None, bias=None)
    reduce_scatter.ReduceEngine.launch(fake, 32, out, src=None, bias=None, signal_done=True)
    reduce_scatter.ReduceEngine.launch(fake, 32, out, src=_P(), bias=None)
    assert launched == [0, abi.RS_SIGNAL_DONE, abi.RS_SIGNAL_DONE]


class _P:
    """A stand-in tensor: only its address is read."""

    def data_ptr(self) -> int:
        return 4096


def test_small_decomposed_gemm_rs_calls_run_cublas_and_the_standalone_reduce_scatter():
    """GEMMReduceScatter's decomposed calls with the cuBLAS GEMM and M <= the standalone ReduceScatter's rows
    (PLAIN_RS_ROWS) run cuBLAS into its input buffer and that op; fused calls, our GEMM, larger M, one PE don't."""
    from types import SimpleNamespace
    from flux_shmem.kernels import backends
    from flux_shmem.ops import gemm_rs
    op = SimpleNamespace(plain_rs=SimpleNamespace(max_rows=gemm_rs.PLAIN_RS_ROWS))
    cublas, ours = SimpleNamespace(name=backends.CUBLAS), SimpleNamespace(name=backends.OURS)
    runs = lambda path, backend, m: gemm_rs.GEMMReduceScatter.plain_rs_runs(  # noqa: E731
        op, SimpleNamespace(path=path, backend=backend), m)
    assert runs("decomposed", cublas, 64) and runs("decomposed", cublas, gemm_rs.PLAIN_RS_ROWS)
    assert not runs("decomposed", cublas, gemm_rs.PLAIN_RS_ROWS + 8)
    assert not runs("fused", cublas, 64) and not runs("decomposed", ours, 64) and not runs("decomposed", None, 64)
    op.plain_rs = None  # (one PE, or rows of a width the standalone op cannot take)
    assert not runs("decomposed", cublas, 64)
