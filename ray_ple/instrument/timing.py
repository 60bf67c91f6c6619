"""Hand-off timestamps for the benchmarks; inert unless `RAY_PLE_TIMING=1` at import.

Off (the default), each instrumented site costs one test of a module constant and nothing is
stored. On, every process keeps its own bounded ring of events, each a tuple of a kind and
`time.monotonic_ns()` stamps. CLOCK_MONOTONIC is one clock for all processes of a host, so
the worker's and the offload actor's stamps subtract directly. The events, in step order::

    worker   ("post", t)                      WorkerPair.step / stream_step, right after
                                              the post (or the announcement), before any ring
    offload  ("wake", t)                      OffloadActor._serve, when its doorbell wait
                                              returned on a ring
    offload  ("gather", T, t_start, t_end)    RowGatherer wrote T rows into the slot
    worker   ("pull", T, t_enter, t_seen, t_done)   CpuTransport.pull: entered, flag seen,
                                              rows copied

A benchmark reads them with `drain()` in each process (`LLM.collective_rpc` for the worker,
`actor.__ray_call__` for the offload actor) and joins them by time. Where no call reaches the
process (a Serve replica's engine), `RAY_PLE_TIMING_DIR` makes each process append its events
to `<dir>/timing-<pid>.jsonl` from a daemon thread, once a second.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque

ENV = "RAY_PLE_TIMING"
ENABLED: bool = os.environ.get(ENV) == "1"
SINK_ENV = "RAY_PLE_TIMING_DIR"
RING_EVENTS = 1 << 16

_RING: deque[tuple[object, ...]] = deque(maxlen=RING_EVENTS)


def record(*event: object) -> None:
    """Append one event; the oldest falls out when the ring is full."""
    _RING.append(event)


def drain(*_ignored: object) -> list[tuple[object, ...]]:
    """Take every event recorded so far in this process (callable as an rpc with a target)."""
    out = []
    while True:
        try:
            out.append(_RING.popleft())
        except IndexError:
            return out


def _flush(path: str) -> None:
    """Append what the ring holds to `path` (whole lines; errors dropped: a bench aid)."""
    if events := drain():
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as f:
                f.write("".join(json.dumps(ev) + "\n" for ev in events))
        except OSError:
            pass


def _sink(path: str) -> None:
    while True:
        time.sleep(1.0)
        _flush(path)


def _start_sink() -> None:
    """One sink thread per process: started at import, and again in each forked child; a
    last flush at exit."""
    _RING.clear()
    path = os.path.join(os.environ[SINK_ENV], f"timing-{os.getpid()}.jsonl")
    threading.Thread(target=_sink, args=(path,), name="ray-ple-timing-sink",
                     daemon=True).start()
    atexit.register(_flush, path)


if ENABLED and os.environ.get(SINK_ENV):
    _start_sink()
    os.register_at_fork(after_in_child=_start_sink)
