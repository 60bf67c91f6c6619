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
from ray_ple.protocol.geometry import ITEMSIZE, DType, PleGeometry
from ray_ple.protocol.layout import (
    ANNOUNCED_OFF,
    LAYOUT_VERSION,
    MAGIC,
    SLEEPING_OFF,
    PairLayout,
)
from ray_ple.protocol.shm import SegmentRef

PAIRS_ENV = "RAY_PLE_PAIRS"  # the out-of-band payload: the engine's pair handles, as JSON


class SlotHandle(Frozen):
    """One slot (one part of one table's row) inside a pair segment: its rows, flag, stamp.

    `name` is the slot's name, the key the pull op resolves (`PleGeometry.slots`:
    the table's own name when it has one part, `table#p` for part p of several); `table`,
    `part`, `first_layer`, `num_layers` and `col_offset` say which model layers and which
    bytes of the table's row it holds.
    """

    name: str
    table: str
    part: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    num_layers: int = Field(gt=0)
    col_offset: int = Field(ge=0)
    index: int = Field(ge=0)
    rows: int = Field(gt=0)
    row_bytes: int = Field(gt=0)
    dtype: DType
    max_tokens: int = Field(gt=0)
    slot_offset: int = Field(ge=0)
    slot_bytes: int = Field(gt=0)
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


def make_pair_handle(*, rank: int, segment: SegmentRef, node_id: str, actor_name: str,
                     fingerprint: str, geometry: PleGeometry, layout: PairLayout) -> PairHandle:
    slots = tuple(
        SlotHandle(
            name=g.name, table=g.table, part=g.part, first_layer=g.first_layer,
            num_layers=g.num_layers, col_offset=g.col_offset,
            index=i, rows=g.rows, row_bytes=g.row_bytes, dtype=g.dtype,
            max_tokens=layout.max_tokens, slot_offset=layout.slot_offsets[i],
            slot_bytes=layout.max_tokens * g.row_bytes, flag_offset=layout.flag_offsets[i],
            published_offset=layout.published_offsets[i],
            stamp_offset=layout.stamp_offsets[i],
        )
        for i, g in enumerate(geometry.slots())
    )
    return PairHandle(
        rank=rank, segment=segment, node_id=node_id, actor_name=actor_name,
        layout_version=layout.version, table_fingerprint=fingerprint,
        control=ControlHandle(count_offset=layout.count_offset, ids_offset=layout.ids_offset,
                              max_tokens=layout.max_tokens, sleeping_offset=SLEEPING_OFF,
                              announced_offset=ANNOUNCED_OFF),
        slots=slots,
    )


def validate_pair_handle(handle: PairHandle, expected: PleGeometry, *, rank: int) -> PairLayout:
    """Check a handle against the geometry this side derived itself; return its layout.

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
    for i, (slot, geo) in enumerate(zip(handle.slots, expected.slots())):
        if slot.index != i:
            raise bad(f"slot {slot.name} has index {slot.index}")
        for field, want in (("table", geo.table), ("part", geo.part),
                            ("first_layer", geo.first_layer), ("num_layers", geo.num_layers),
                            ("col_offset", geo.col_offset),
                            ("rows", geo.rows), ("row_bytes", geo.row_bytes),
                            ("dtype", geo.dtype), ("max_tokens", expected.max_tokens),
                            ("slot_bytes", expected.max_tokens * geo.row_bytes)):
            if getattr(slot, field) != want:
                raise bad(f"{slot.name}.{field} = {getattr(slot, field)!r}, "
                          f"expected {want!r}")
        if slot.row_bytes % ITEMSIZE[slot.dtype]:
            raise bad(f"{slot.name}.row_bytes not a multiple of {slot.dtype}")
    layout = handle.layout()
    for slot in handle.slots:
        i = slot.index
        for field, want in (("slot_offset", layout.slot_offsets[i]),
                            ("flag_offset", layout.flag_offsets[i]),
                            ("published_offset", layout.published_offsets[i]),
                            ("stamp_offset", layout.stamp_offsets[i])):
            if getattr(slot, field) != want:
                raise bad(f"{slot.name}.{field} = {getattr(slot, field)}, layout says {want}")
    c = handle.control
    if ((c.count_offset, c.ids_offset, c.sleeping_offset, c.announced_offset)
            != (layout.count_offset, layout.ids_offset, SLEEPING_OFF, ANNOUNCED_OFF)):
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
