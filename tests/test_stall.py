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
