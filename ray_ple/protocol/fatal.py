"""The one fatal path: mark the pair FAILED, one bounded structured line, exit.

Nothing clever on the way down: no retry, no reset, no cleanup that could block. The kernel
frees the shared memory with its last holder; the supervisor ends the rest of the replica.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
from typing import Any, NamedTuple, NoReturn

from ray_ple.log import log_event
from ray_ple.protocol.layout import ControlBlock, Side, State

EXIT_CODE = 86


class Reason(enum.IntEnum):
    """Why correspondence was lost; written into the control block and every verdict."""

    NONE = 0
    COUNTER_SKIP = 1
    COUNTER_BACK = 2
    INVARIANT = 3
    OFFLOAD_WAIT = 4
    CONSUME_WAIT = 5
    STEP_DEADLINE = 6
    ABANDONED = 7
    PEER_DEAD = 8
    HEARTBEAT = 9
    TOKEN_COUNT = 10
    PEER_FAILED = 11
    SEGMENT_LOST = 12
    STARTUP_DEADLINE = 13
    NO_TRANSACTION = 14
    STATE = 15
    GEOMETRY = 16
    PEER_STOPPED = 17
    PUBLISH_DEADLINE = 18
    STREAM_POST = 19  # the GPU stream found the counters or state unfit to post its step


class Failure(NamedTuple):
    """A broken rule, as the rule found it; the caller decides how to end (exit or kill)."""

    reason: Reason
    detail: str
    slot: int | None = None  # the slot's index, where the rule concerns one


def mark_failed(block: ControlBlock | None, reason: Reason) -> None:
    """First writer wins: a FAILED block keeps its first reason."""
    if block is not None:
        try:
            block.fail(reason)
        except Exception:  # noqa: BLE001 - the segment may be gone; we are exiting anyway
            pass


def fail_closed(side: Side, reason: Reason, *, block: ControlBlock | None = None,
                rank: int | None = None, slot: str | None = None, seq: int | None = None,
                detail: str = "", **fields: Any) -> NoReturn:
    """End this process now; the pair is marked FAILED so that every watcher sees why.

    The line's time is the finding's, taken before the mark: a supervisor that reads FAILED
    before this line is written still logs its detection after the side's.
    """
    found_at = time.time()
    mark_failed(block, reason)
    log_event("verdict", level=logging.ERROR, ts=found_at, where=side.value,
              reason=reason.name, rank=rank, slot=slot, seq=seq, detail=detail[:500],
              **fields)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


__all__ = ["EXIT_CODE", "Failure", "Reason", "Side", "State", "fail_closed", "mark_failed"]
