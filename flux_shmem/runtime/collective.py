"""Host collectives of construction time, bounded and failure-aware.

Building an op is collective (symmetric buffers, agreed arguments and planner inputs). A PE that raises while
others go on would leave them blocked in the next collective forever, so:

* every construction-time collective is an `exchange`: a barrier that gives up after the runtime's timeout
  (FLUX_SHMEM_TIMEOUT_S), then an allgather of (status, value) from every PE. A PE that failed contributes its
  error instead of a value, so the exchange it joins (whichever its peers are in: they are all exchanges) tells
  every PE who failed and why;
* `all_or_none(what)` wraps the local part of a construction (argument checks, environment variables, kernel
  loads, the SM budget): when it ends, every PE learns whether all of them got through. A PE that failed raises
  its own error, the others a PeerFailure naming each failing PE and its message; nobody enters the collective
  part of the construction alone.

After a timeout the job's host collectives are out of step: the PE raises and must not make further calls.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from ..errors import FluxShmemError, NotInitializedError
from .host import HostCollectives
from .state import get_runtime

_OK, _FAILED = "ok", "failed"


class PeerFailure(FluxShmemError):
    """Another PE failed in a collective call this PE took part in (its message is in this one)."""


def _reported(e: BaseException) -> bool:
    return isinstance(e, PeerFailure) or getattr(e, "_flux_shmem_reported", False)


def _host(host: Optional[HostCollectives], timeout_s: Optional[float]) -> tuple[HostCollectives, float]:
    if host is None or timeout_s is None:
        rt = get_runtime()
        host = rt.host if host is None else host
        timeout_s = rt.timeout_s if timeout_s is None else timeout_s
    return host, timeout_s


def exchange(what: str, value: Any = None, *, failure: Optional[BaseException] = None,
             host: Optional[HostCollectives] = None, timeout_s: Optional[float] = None) -> list:
    """Every PE's `value` (indexed by rank), once all PEs joined within `timeout_s`; FluxShmemError naming this PE
    when they did not. A PE passes `failure` instead of a value to report its error: then every PE raises
    (PeerFailure on the others, naming each failing PE and its message; the failing PE re-raises `failure`)."""
    host, timeout_s = _host(host, timeout_s)
    if not host.barrier_within(timeout_s):
        raise FluxShmemError(f"PE {host.rank}: not every PE joined the collective call {what} within "
                             f"{timeout_s:g} s: every PE must make the same collective calls in the same order "
                             "(a PE that failed or stopped before it leaves the others here)")
    mine = (_FAILED, f"{type(failure).__name__}: {failure}") if failure is not None else (_OK, value)
    got = host.allgather(mine)
    failed = [(pe, msg) for pe, (status, msg) in enumerate(got) if status == _FAILED]
    if failed:
        if failure is not None:
            failure._flux_shmem_reported = True  # (an enclosing all_or_none must not report it again)
            raise failure
        raise PeerFailure(f"PE {host.rank}: {what} failed on " + "; ".join(f"PE {pe}: {msg}" for pe, msg in failed))
    return [v for _, v in got]


@contextlib.contextmanager
def all_or_none(what: str) -> Iterator[None]:
    """The local part of a collective construction: on exit every PE learns whether every PE got through (one
    `exchange`); if any failed, all raise (see the module docstring). Without a runtime there is nobody to tell:
    errors pass through."""
    try:
        yield
    except BaseException as e:
        if _reported(e) or isinstance(e, (NotInitializedError, KeyboardInterrupt)):
            raise
        try:
            get_runtime()
        except NotInitializedError:
            raise e from None
        exchange(what, failure=e)
        raise
    else:
        exchange(what)
