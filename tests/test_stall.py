"""Stall reports (flux_shmem/runtime/stall.py), without a GPU: the setting, and a report after a stall."""
import time

import pytest

from flux_shmem.runtime import stall


def test_interval_setting():
    assert stall.interval_from({}) is None
    assert stall.interval_from({stall.ENV: "0"}) is None
    assert stall.interval_from({stall.ENV: "2.5"}) == 2.5
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match=stall.ENV):
            stall.interval_from({stall.ENV: bad})


class _Ev:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_report_names_the_pending_stage(capsys):
    w = stall._Watcher(0.2, pe=3, device=0)
    tr = w.begin("AllGatherGEMM")
    tr.stages += [("gather kernel finished", "comm", _Ev(True)), ("start gate opened", "main", _Ev(False))]
    time.sleep(1.0)  # no further call: one report
    err = capsys.readouterr().err
    assert "PE 3: no op call for" in err and "AllGatherGEMM call 1" in err
    assert "[done] gather kernel finished (comm)" in err and "[PENDING] start gate opened (main)" in err
    assert err.count("no op call") == 1  # once per stall, not every interval
    assert "thread MainThread:" in err and "test_report_names_the_pending_stage" in err  # where the host waits
    w.begin("AllGatherGEMM")  # progress re-arms it
    time.sleep(1.0)
    assert capsys.readouterr().err.count("no op call") == 1


def test_timed_stages_collects_every_call():
    assert stall.begin("X") is None  # off: no trace, no cost
    with stall.timed_stages() as calls:
        tr = stall.begin("GEMMReduceScatter")
        assert tr is not None and tr.timed and calls == [tr]
        with pytest.raises(RuntimeError, match="already active"):
            with stall.timed_stages():
                pass
    assert stall.begin("X") is None


class _TimedEv:
    def __init__(self, t):
        self.t = t

    def elapsed_time(self, other):
        return other.t - self.t


def test_stage_offsets_from_a_start_event():
    tr = stall.Trace("AllGatherGEMM", 1, timed=True)
    tr.stages += [("start gate opened", "main", _TimedEv(0.05)), ("fused GEMM (62 CTAs) finished", "main",
                                                                  _TimedEv(1.30))]
    got = stall.stage_offsets_ms(tr, _TimedEv(0.0))
    assert [(a, b) for a, b, _ in got] == [("start gate opened", "main"), ("fused GEMM (62 CTAs) finished", "main")]
    assert [round(t, 3) for *_, t in got] == [0.05, 1.3]
