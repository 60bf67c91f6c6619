"""One structured line per event.

Lines are JSON objects with a fixed `event` key so that a platform engineer can grep one
event across replicas, workers and offload actors without parsing prose.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

_logger = logging.getLogger("ray_ple")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(os.environ.get("RAY_PLE_LOG_LEVEL", "INFO"))
    _logger.propagate = False


def log_event(event: str, level: int = logging.INFO, *, ts: float | None = None,
              **fields: Any) -> None:
    """Emit `{"ray_ple": event, ...}` as one line; `ts` when the event happened before now."""
    record = {"ray_ple": event, "ts": round(time.time() if ts is None else ts, 6),
              "pid": os.getpid()}
    record.update(fields)
    _logger.log(level, json.dumps(record, default=str, separators=(",", ":")))


class Progress:
    """Rate-limited progress lines for long operations (table load, model build)."""

    def __init__(self, event: str, total: int, every_s: float = 2.0, **fields: Any) -> None:
        self._event, self._total, self._every, self._fields = event, total, every_s, fields
        self._start = self._last = time.monotonic()
        log_event(event, phase="start", total=total, **fields)

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            pct = round(100.0 * done / self._total, 1) if self._total else 100.0
            log_event(self._event, phase="progress", done=done, total=self._total,
                      percent=pct, elapsed_s=round(now - self._start, 2), **self._fields)

    def finish(self, **extra: Any) -> None:
        log_event(self._event, phase="done", total=self._total,
                  elapsed_s=round(time.monotonic() - self._start, 3), **self._fields, **extra)
