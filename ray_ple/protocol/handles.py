"""Handles: the one object that crosses from the offload actor to the worker.

A handle names a live segment and its whole geometry. It is exchanged once at setup, through
the supervisor, and the worker validates every field (against the layout it recomputes, the
segment's own header, and its own model) before it maps or registers anything.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from ray_ple.base import Frozen
from ray_ple.errors import PleHandleError
from ray_ple.protocol.geometry import PleGeometry, SlotGeometry
from ray_ple.protocol.layout import (
    ANNOUNCED_OFF,
    LAYOUT_VERSION,
    MAGIC,
    SLEEPING_OFF,
    PairLayout,
)
from ray_ple.protocol.shm import SegmentRef

PAIRS_ENV = "RAY_PLE_PAIRS"  # the out-of-band payload: the engine's pair handles, as JSON


class SlotHandle(SlotGeometry):
    """One slot inside a pair segment: its geometry (`SlotGeometry`; `name` is the key the
    pull op resolves) and where `index`'s rows, flag, `published` and stamp lie in the segment.
    Built only by `slot_handles`, which the worker's validation builds again to compare.
    """

    index: int = Field(ge=0)
    slot_offset: int = Field(ge=0)
    flag_offset: int = Field(ge=0)
    published_offset: int = Field(ge=0)
    stamp_offset: int = Field(ge=0)


class ControlHandle(Frozen):
    """The control block: state, heartbeats, counters and the input slot."""

    count_offset: int = Field(ge=0)
    ids_offset: int = Field(ge=0)
    max_tokens: int = Field(gt=0)
    sleeping_offset: int = Field(ge=0)
    announced_offset: int = Field(ge=0)


class PairHandle(Frozen):
    """Everything a worker of `rank` needs to map its pair; valid while the actor lives."""

    rank: int = Field(ge=0)
    segment: SegmentRef
    node_id: str
    actor_name: str
    layout_version: int
    table_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    control: ControlHandle
    slots: tuple[SlotHandle, ...] = Field(min_length=1)

    @property
    def slot_names(self) -> tuple[str, ...]:
        """The slot names, in slot order (the pull op's keys)."""
        return tuple(s.name for s in self.slots)

    def layout(self) -> PairLayout:
        return PairLayout.compute(self.control.max_tokens, tuple(s.row_bytes for s in self.slots),
                                  version=self.layout_version)


class EngineHandles(Frozen):
    """Every worker's pair handle of one engine: the out-of-band payload (`RAY_PLE_PAIRS`).

    Per-process names (segments, actors) never enter vLLM's compile key, so they travel in
    the environment of the engine's processes rather than in `additional_config`.
    """

    pairs: tuple[PairHandle, ...] = Field(min_length=1)

    def env(self) -> dict[str, str]:
        return {PAIRS_ENV: self.model_dump_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> EngineHandles:
        raw = environ.get(PAIRS_ENV)
        if not raw:
            raise PleHandleError(
                f"{PAIRS_ENV} is not set: this engine was configured for PLE offload but started "
                "without its offload actors (start it through ray_ple, not plain vLLM)")
        try:
            return cls.model_validate_json(raw)
        except ValueError as exc:
            raise PleHandleError(f"{PAIRS_ENV} does not hold valid pair handles: {exc}") from exc


class EngineAttached(Frozen):
    """Every worker of the engine attached to its pair (pids, watched from now on)."""

    worker_pids: tuple[int, ...]


def slot_handles(geometry: PleGeometry, layout: PairLayout) -> tuple[SlotHandle, ...]:
    """Every slot of `geometry` where `layout` puts it: the one place a slot handle is built."""
    return tuple(
        SlotHandle(**g.model_dump(), index=i, slot_offset=layout.slot_offsets[i],
                   flag_offset=layout.flag_offsets[i],
                   published_offset=layout.published_offsets[i],
                   stamp_offset=layout.stamp_offsets[i])
        for i, g in enumerate(geometry.slots()))


def control_handle(layout: PairLayout) -> ControlHandle:
    return ControlHandle(count_offset=layout.count_offset, ids_offset=layout.ids_offset,
                         max_tokens=layout.max_tokens, sleeping_offset=SLEEPING_OFF,
                         announced_offset=ANNOUNCED_OFF)


def make_pair_handle(*, rank: int, segment: SegmentRef, node_id: str, actor_name: str,
                     fingerprint: str, geometry: PleGeometry, layout: PairLayout) -> PairHandle:
    return PairHandle(
        rank=rank, segment=segment, node_id=node_id, actor_name=actor_name,
        layout_version=layout.version, table_fingerprint=fingerprint,
        control=control_handle(layout), slots=slot_handles(geometry, layout))


def validate_pair_handle(handle: PairHandle, expected: PleGeometry, *, rank: int) -> PairLayout:
    """Check a handle against the one this side builds from its own geometry; return the
    layout.

    One `PleHandleError` naming the first field that differs. Nothing is mapped here.
    """
    def bad(what: str) -> PleHandleError:
        return PleHandleError(f"pair handle for rank {rank} rejected: {what}")

    if handle.rank != rank:
        raise bad(f"it is for rank {handle.rank}")
    if handle.layout_version != LAYOUT_VERSION:
        raise bad(f"layout version {handle.layout_version}, this side speaks {LAYOUT_VERSION}")
    if handle.slot_names != expected.slot_names:
        raise bad(f"slot names {list(handle.slot_names)} != {list(expected.slot_names)}")
    if handle.control.max_tokens != expected.max_tokens:
        raise bad(f"max_tokens {handle.control.max_tokens} != {expected.max_tokens}")
    layout = PairLayout.compute(expected.max_tokens,
                                tuple(s.row_bytes for s in expected.slots()))
    for slot, want in zip(handle.slots, slot_handles(expected, layout)):
        for field in SlotHandle.model_fields:
            if getattr(slot, field) != getattr(want, field):
                raise bad(f"{slot.name}.{field} = {getattr(slot, field)!r}, "
                          f"expected {getattr(want, field)!r}")
    if handle.control != control_handle(layout):
        raise bad("control offsets differ from the layout")
    if handle.segment.size != layout.size:
        raise bad(f"segment size {handle.segment.size} != layout size {layout.size}")
    return layout


def validate_segment_header(header: tuple[int, int, int, int, str, str],
                            handle: PairHandle) -> None:
    """The mapped segment must say what the handle says (guards fd reuse and stale handles)."""
    magic, version, n_slots, max_tokens, token, fingerprint = header
    if magic != MAGIC:
        raise PleHandleError(f"segment of rank {handle.rank} is not a ray-ple pair "
                             f"(magic {magic:#x})")
    if (version, n_slots, max_tokens) != (handle.layout_version, len(handle.slots),
                                           handle.control.max_tokens):
        raise PleHandleError(f"segment header (v{version}, {n_slots} slots, {max_tokens} tokens) "
                             f"differs from the handle of rank {handle.rank}")
    if token != handle.segment.token:
        raise PleHandleError(f"segment token of rank {handle.rank} differs from the handle")
    if fingerprint != handle.table_fingerprint:
        raise PleHandleError(f"table fingerprint of rank {handle.rank} differs from the handle")
