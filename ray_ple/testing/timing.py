"""Hand-off timestamps for the benchmarks; inert unless `RAY_PLE_TIMING=1` at import.

Off (the default), each instrumented site costs one test of a module constant and nothing is
stored. On, every process keeps its own bounded ring of events, each a tuple of a kind and
`time.monotonic_ns()` stamps. CLOCK_MONOTONIC is one clock for all processes of a host, so
the worker's and the offload actor's stamps subtract directly. The events, in step order::

    worker   ("post", t)                      Doorbell.ring, right after `posted = s`
    offload  ("wake", t)                      DoorbellListener.wait returned on a ring
    offload  ("gather", T, t_start, t_end)    RowGatherer wrote T rows into the slot
    worker   ("pull", T, t_enter, t_seen, t_done)   CpuTransport.pull: entered, flag seen,
                                              rows copied

A benchmark reads them with `drain()` in each process (`LLM.collective_rpc` for the worker,
`actor.__ray_call__` for the offload actor) and joins them by time.
"""

from __future__ import annotations

import os
from collections import deque

ENV = "RAY_PLE_TIMING"
ENABLED: bool = os.environ.get(ENV) == "1"
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
