"""Byte layout of one pair segment, and typed views over it.

    words    header: magic, layout version, slot count, max_tokens, token, fingerprint;
             then one 64-byte cache line each for state+reason, the two heartbeats,
             `posted`, `released`, the worker's pid, the last post and publish times,
             `sleeping` (the offload side is about to block on its doorbell), `announced` (the
             step the worker will post next, ahead of a post the GPU stream writes); per slot
             a 192-byte block of three cache lines: `flag` (u32), `published` (u64) and
             `stamp` (u64: the step whose rows the slot holds, written after the rows,
             before the flag).
             As many pages as the slots need (one page up to 16 slots).
    then     input slot, page aligned: token count T (u32), then `max_tokens` int32 ids
    then     per slot, page aligned: output slot of exactly max_tokens x row_bytes

A slot is one part of one table's row (`PleGeometry.slots`): a table split into P parts of
consecutive model layers has P slots, each with its own flag, raised as soon as its rows
are written. The layout is a pure function of (version, max_tokens, row_bytes per slot), so
a worker recomputes it and rejects any handle whose offsets differ.
"""

from __future__ import annotations

import enum
import os
import struct
from typing import NamedTuple

import numpy as np

from ray_ple.base import Frozen
from ray_ple.errors import PleHandleError
from ray_ple.protocol.shm import SharedSegment, page_align

LAYOUT_VERSION = 3  # 2: slots per part, a step stamp per slot, `sleeping`; 3: `announced`
MAGIC = 0x31454C505941522E  # ".RAYPLE1"
_HDR = struct.Struct("<QIIQ16s32s")  # magic, version, n_slots, max_tokens, token, fingerprint
STATE_OFF, HB_WORKER_OFF, HB_OFFLOAD_OFF, POSTED_OFF, RELEASED_OFF = 128, 192, 256, 320, 384
WORKER_PID_OFF, POST_NS_OFF, PUBLISH_NS_OFF, SLEEPING_OFF = 448, 512, 576, 640
ANNOUNCED_OFF = 704
SLOTS_OFF, SLOT_STRIDE = 1024, 192  # per slot: flag @ +0, published @ +64, stamp @ +128
PUBLISHED_IN_SLOT, STAMP_IN_SLOT = 64, 128
MAX_SLOTS = 128
SNAPSHOT_TRIES = 8  # passes over the counters before a snapshot says it found no instant


class Side(enum.Enum):
    """Who acts: the two sides of a pair, the consumer inside the worker, the supervisor."""

    WORKER = "worker"
    OFFLOAD = "offload"
    CONSUMER = "consumer"  # the worker's engine thread (CPU) or model stream (CUDA)
    SUPERVISOR = "supervisor"


class Counters(NamedTuple):
    """The transaction counters of one pair, as one read saw them."""

    posted: int
    published: tuple[int, ...]
    released: int


class State(enum.IntEnum):
    INIT = 0
    READY = 1
    FAILED = 2
    CLOSED = 3


class PairLayout(Frozen):
    """Offsets of every field of one pair segment."""

    version: int
    max_tokens: int
    row_bytes: tuple[int, ...]
    words_bytes: int
    count_offset: int
    ids_offset: int
    flag_offsets: tuple[int, ...]
    published_offsets: tuple[int, ...]
    stamp_offsets: tuple[int, ...]
    slot_offsets: tuple[int, ...]
    size: int

    @classmethod
    def compute(cls, max_tokens: int, row_bytes: tuple[int, ...],
                version: int = LAYOUT_VERSION) -> PairLayout:
        if not 0 < len(row_bytes) <= MAX_SLOTS:
            raise PleHandleError(f"{len(row_bytes)} slots; a pair holds 1..{MAX_SLOTS}")
        n = len(row_bytes)
        words = page_align(SLOTS_OFF + n * SLOT_STRIDE)
        count_off = words
        ids_off = words + 64
        cursor = page_align(ids_off + 4 * max_tokens)
        slots = []
        for rb in row_bytes:
            slots.append(cursor)
            cursor = page_align(cursor + max_tokens * rb)
        return cls(
            version=version, max_tokens=max_tokens, row_bytes=tuple(row_bytes),
            words_bytes=words, count_offset=count_off, ids_offset=ids_off,
            flag_offsets=tuple(SLOTS_OFF + i * SLOT_STRIDE for i in range(n)),
            published_offsets=tuple(SLOTS_OFF + i * SLOT_STRIDE + PUBLISHED_IN_SLOT
                                    for i in range(n)),
            stamp_offsets=tuple(SLOTS_OFF + i * SLOT_STRIDE + STAMP_IN_SLOT for i in range(n)),
            slot_offsets=tuple(slots), size=cursor,
        )


def _u64(buf, off: int) -> np.ndarray:
    return np.ndarray((1,), np.uint64, buf, off)


def _u32(buf, off: int, n: int = 1) -> np.ndarray:
    return np.ndarray((n,), np.uint32, buf, off)


class ControlBlock:
    """Typed views of a mapped pair segment. Rules live in `ray_ple.protocol.transaction`."""

    def __init__(self, seg: SharedSegment | None, layout: PairLayout,
                 words: bytearray | None = None) -> None:
        buf = seg.map if seg is not None else words
        self.segment, self.layout = seg, layout
        self.stable = True  # a mapped block, or a snapshot whose counters are one instant's
        self._state = _u32(buf, STATE_OFF, 2)
        self._hb_worker = _u64(buf, HB_WORKER_OFF)
        self._hb_offload = _u64(buf, HB_OFFLOAD_OFF)
        self._posted = _u64(buf, POSTED_OFF)
        self._released = _u64(buf, RELEASED_OFF)
        self._worker_pid = _u64(buf, WORKER_PID_OFF)
        self._post_ns = _u64(buf, POST_NS_OFF)
        self._publish_ns = _u64(buf, PUBLISH_NS_OFF)
        self._sleeping = _u32(buf, SLEEPING_OFF)
        self._announced = _u64(buf, ANNOUNCED_OFF)
        self.flags = [_u32(buf, off) for off in layout.flag_offsets]
        self._published = [_u64(buf, off) for off in layout.published_offsets]
        # every slot's `published` as one strided view: the post reads them in one call
        self._published_all = np.ndarray((len(layout.published_offsets),), np.uint64, buf,
                                         layout.published_offsets[0], strides=(SLOT_STRIDE,))
        self._stamps = [_u64(buf, off) for off in layout.stamp_offsets]
        if seg is None:
            return  # a snapshot of the words page: no input or output slots
        self._count = _u32(buf, layout.count_offset)
        self.ids = np.ndarray((layout.max_tokens,), np.int32, buf, layout.ids_offset)
        self.slots = [np.ndarray((layout.max_tokens, rb), np.uint8, buf, off)
                      for rb, off in zip(layout.row_bytes, layout.slot_offsets)]

    @classmethod
    def snapshot(cls, fd: int, layout: PairLayout,
                 tries: int = SNAPSHOT_TRIES) -> ControlBlock | None:
        """The words pages read with pread, never mapped: a watcher cannot fault on a segment
        that was taken away. None when the segment is shorter than its layout.

        The counters are then read like a seqlock, pass after pass (`released`, `published`,
        `posted`, one pread each) until two consecutive passes agree: counters only grow, so
        two equal passes are one instant's values (each counter held its value from the end
        of the first pass to the start of the second). No two passes agree within `tries`:
        the block's `stable` is False and its counters are no instant's (read again later).
        """
        if os.fstat(fd).st_size < layout.size:
            return None
        words = bytearray(os.pread(fd, layout.words_bytes, 0))
        if len(words) != layout.words_bytes:
            return None
        offsets = (RELEASED_OFF, *layout.published_offsets, POSTED_OFF)
        seen: list[bytes] = []
        stable = False
        for _ in range(tries):
            now = [os.pread(fd, 8, off) for off in offsets]
            if any(len(word) != 8 for word in now):
                return None
            stable, seen = now == seen, now
            if stable:
                break
        for off, word in zip(offsets, seen):
            words[off:off + 8] = word
        block = cls(None, layout, words)
        block.stable = stable
        return block

    @staticmethod
    def write_state(fd: int, state: State) -> None:
        """Set the state word through the fd (an orderly close)."""
        os.pwrite(fd, struct.pack("<I", int(state)), STATE_OFF)

    @staticmethod
    def write_failure(fd: int, reason: int) -> None:
        """Mark FAILED through the fd (the watcher's verdict); an earlier reason stays."""
        if struct.unpack("<I", os.pread(fd, 4, STATE_OFF + 4))[0] == 0:
            os.pwrite(fd, struct.pack("<I", int(reason)), STATE_OFF + 4)
        os.pwrite(fd, struct.pack("<I", int(State.FAILED)), STATE_OFF)

    # header -------------------------------------------------------------------------
    def write_header(self, token: str, fingerprint: str) -> None:
        self.segment.map[: _HDR.size] = _HDR.pack(
            MAGIC, self.layout.version, len(self.layout.row_bytes), self.layout.max_tokens,
            bytes.fromhex(token), bytes.fromhex(fingerprint))

    def read_header(self) -> tuple[int, int, int, int, str, str]:
        magic, ver, n, max_tokens, token, fp = _HDR.unpack_from(self.segment.map, 0)
        return magic, ver, n, max_tokens, token.hex(), fp.hex()

    # words ----------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """FAILED once any reason is set, whatever the state word says: the reason word is
        written only by a failure and never reset, so a concurrent CLOSED (or READY) store to
        the state word can never hide a failure (no compare-and-swap needed)."""
        if int(self._state[1]) != 0:
            return State.FAILED
        return State(int(self._state[0]))

    def ready(self) -> bool:
        """READY and no reason set, in one read of both words (the post's fast path)."""
        state, reason = self._state.tolist()
        return reason == 0 and state == State.READY

    @property
    def reason(self) -> int:
        return int(self._state[1])

    def set_state(self, state: State) -> None:
        """INIT, READY or CLOSED; a failure is `fail`."""
        if state is State.FAILED:
            raise ValueError("FAILED carries a reason: use fail()")
        self._state[0] = int(state)

    def fail(self, reason: int) -> None:
        """FAILED with `reason`; the first reason written stays."""
        if int(self._state[1]) == 0:
            self._state[1] = int(reason)
        self._state[0] = int(State.FAILED)

    @property
    def posted(self) -> int:
        return int(self._posted[0])

    @posted.setter
    def posted(self, v: int) -> None:
        self._posted[0] = v

    @property
    def released(self) -> int:
        return int(self._released[0])

    @released.setter
    def released(self, v: int) -> None:
        self._released[0] = v

    def published(self, slot: int) -> int:
        return int(self._published[slot][0])

    def set_published(self, slot: int, v: int) -> None:
        self._published[slot][0] = v

    def stamp(self, slot: int) -> int:
        """The step whose rows slot `slot` holds (written with the rows, before the flag)."""
        return int(self._stamps[slot][0])

    def set_stamp(self, slot: int, v: int) -> None:
        self._stamps[slot][0] = v

    @property
    def sleeping(self) -> bool:
        """The offload side is blocked (or about to block) on its doorbell: ring it."""
        return bool(self._sleeping[0])

    @sleeping.setter
    def sleeping(self, v: bool) -> None:
        self._sleeping[0] = int(v)

    @property
    def announced(self) -> int:
        """The last step the worker said it posts (itself, or by its GPU stream)."""
        return int(self._announced[0])

    @announced.setter
    def announced(self, v: int) -> None:
        self._announced[0] = v

    @property
    def token_count(self) -> int:
        return int(self._count[0])

    @token_count.setter
    def token_count(self, v: int) -> None:
        self._count[0] = v

    def _beat_word(self, side: Side) -> np.ndarray:
        if side is Side.WORKER:
            return self._hb_worker
        if side is Side.OFFLOAD:
            return self._hb_offload
        raise ValueError(f"only the two sides of a pair beat, not {side}")

    def beat(self, side: Side, now_ns: int) -> None:
        self._beat_word(side)[0] = now_ns

    def heartbeat(self, side: Side) -> int:
        return int(self._beat_word(side)[0])

    @property
    def worker_pid(self) -> int:
        return int(self._worker_pid[0])

    @worker_pid.setter
    def worker_pid(self, v: int) -> None:
        self._worker_pid[0] = v

    def set_post_time(self, now_ns: int) -> None:
        """Monotonic time of the last post (hand-off latency metric)."""
        self._post_ns[0] = now_ns

    def set_publish_time(self, now_ns: int) -> None:
        """Monotonic time of the last complete publish."""
        self._publish_ns[0] = now_ns

    def handoff_times(self) -> tuple[int, int]:
        """(last post, last publish), monotonic ns: the hand-off metric's two ends."""
        return int(self._post_ns[0]), int(self._publish_ns[0])

    def counters(self) -> Counters:
        """Read in the order that cannot tear across steps: `released` (moves last), then
        `published`, then `posted` (moves first); a later word is never older than an earlier."""
        released = int(self._released[0])
        published = tuple(self._published_all.tolist())  # aligned 8-byte loads, in slot order
        return Counters(int(self._posted[0]), published, released)
