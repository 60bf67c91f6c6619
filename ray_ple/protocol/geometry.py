"""What is offloaded, and its exact shape: derived once from the checkpoint's config.

Both sides of a pair and the supervisor compare these values; a mismatch anywhere is a setup
error, never something to adapt to at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_ple.errors import PleConfigError, PleModelError

DType = Literal["bfloat16", "float16", "float32"]
ITEMSIZE: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
_SAFETENSORS_DTYPE: dict[str, str] = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class ArchSpec(BaseModel):
    """How one vLLM architecture holds its PLE table."""

    model_config = ConfigDict(frozen=True)
    module: str  # the vLLM module that holds the table; the table's name
    offload_arch: str
    checkpoint_tensors: tuple[str, ...]
    late_waits: bool = False  # its offload class pulls each part at its first layer's gate
    media_arch: str | None = None  # its offload class with media, where served
    media: tuple[str, ...] = ()  # the modalities vLLM 0.32 serves for it (`limit_mm_per_prompt`)


# Architectures whose PLE lookup ray-ple replaces (vLLM 0.32 module prefixes).
ARCHITECTURES: dict[str, ArchSpec] = {
    "Gemma4ForCausalLM": ArchSpec(
        module="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma4ForCausalLM",
        checkpoint_tensors=(
            "model.embed_tokens_per_layer.weight",
            "model.language_model.embed_tokens_per_layer.weight",
        ),
        late_waits=True,
    ),
    # The released E2B/E4B checkpoints: as text through the same class (vLLM's
    # Gemma4ForCausalLM maps `model.language_model.*` and skips the vision/audio towers); with
    # media asked for, through vLLM's multimodal class around it (video as frames through
    # the vision tower).
    "Gemma4ForConditionalGeneration": ArchSpec(
        module="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma4ForCausalLM",
        checkpoint_tensors=("model.language_model.embed_tokens_per_layer.weight",),
        late_waits=True,
        media_arch="RayPleGemma4ForConditionalGeneration",
        media=("audio", "image", "video"),
    ),
    # vLLM's own text Gemma3nForCausalLM never reads its PLE table (only its multimodal class
    # does); the offload class is that class's text path (worker/vllm_plugin/gemma3n.py).
    "Gemma3nForCausalLM": ArchSpec(
        module="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma3nForCausalLM",
        checkpoint_tensors=(
            "model.embed_tokens_per_layer.weight",
            "model.language_model.embed_tokens_per_layer.weight",
        ),
    ),
    # The released E2B/E4B checkpoints: as text through the same class; with media asked
    # for, through vLLM's multimodal class around it.
    "Gemma3nForConditionalGeneration": ArchSpec(
        module="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma3nForCausalLM",
        checkpoint_tensors=("model.language_model.embed_tokens_per_layer.weight",),
        media_arch="RayPleGemma3nForConditionalGeneration",
        media=("audio", "image"),
    ),
}


class TableGeometry(BaseModel):
    """One offloaded table: `rows` x `row_elems` of `dtype`; a token reads one row."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str  # the model module that holds it (`ArchSpec.module`); its slots' `table`
    rows: int = Field(gt=0)
    row_elems: int = Field(gt=0)
    dtype: DType

    @property
    def row_bytes(self) -> int:
        return self.row_elems * ITEMSIZE[self.dtype]

    @property
    def table_bytes(self) -> int:
        return self.rows * self.row_bytes


class SlotGeometry(BaseModel):
    """One slot of a pair: part `part` of table `table`, model layers `first_layer` on.

    Its rows are the columns `[col_offset, col_offset + row_bytes)` (bytes) of the table's
    rows: the `num_layers * d` values of its layers, consecutive in a row.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    table: str
    table_index: int = Field(ge=0)
    part: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    num_layers: int = Field(gt=0)
    rows: int = Field(gt=0)
    row_elems: int = Field(gt=0)
    col_offset: int = Field(ge=0)
    dtype: DType

    @property
    def row_bytes(self) -> int:
        return self.row_elems * ITEMSIZE[self.dtype]


def slot_name(table: str, part: int, parts: int) -> str:
    """A table of one part keeps its own name (the v1 slot); part p of several is `table#p`."""
    return table if parts == 1 else f"{table}#{part}"


Parts = int | Literal["auto"] | tuple[int, ...]


def split_layers(num_layers: int, parts: Parts, resident_layers: int = 0) -> tuple[int, ...]:
    """Layers per part, in order, of the `num_layers` offloaded layers of a row (those after
    `resident_layers`, named in an error).

    An int n: n parts, as even as can be (earlier parts never larger). A tuple: those
    layers per part, covering them. "auto": one part up to 6 layers; above, parts that
    double from one layer (1, 2, 4, ...) until the rest is under three times the next size,
    then the rest (E4B's 42 -> 1, 2, 4, 8, 27, or its 41 after a resident layer -> 1, 2, 4,
    8, 26; E2B's 35 -> 1, 2, 4, 8, 20). A small first
    part is up before layer 0's gate even at thousands of tokens; each later part's gather
    has its predecessors' layers to hide behind, which grow as fast as the parts do; and
    few parts keep the forks, waits and joins few (docs/history.md, the late pull).
    """
    offloads = f"the table's row offloads {num_layers} layers" + (
        f" (after ple.resident_layers={resident_layers})" if resident_layers else "")
    if isinstance(parts, tuple):
        if not parts or min(parts) < 1 or sum(parts) != num_layers:
            raise PleConfigError(f"ple.parts={list(parts)}: {offloads}, so parts of >= 1 layer "
                                 f"that add up to {num_layers}")
        return parts
    if parts == "auto":
        return _doubling(num_layers) if num_layers > 6 else (num_layers,)
    n = int(parts)
    if not 1 <= n <= num_layers:
        raise PleConfigError(f"ple.parts={parts}: {offloads}, so 1..{num_layers} parts")
    base, extra = divmod(num_layers, n)
    return tuple(base + (1 if i >= n - extra else 0) for i in range(n))


def _doubling(num_layers: int) -> tuple[int, ...]:
    out, size, rest = [], 1, num_layers
    while rest:
        take = rest if rest < 3 * size else size
        out.append(take)
        rest -= take
        size *= 2
    return tuple(out)


class PleGeometry(BaseModel):
    """Everything both sides must agree on before the first transaction.

    `row_layers` is how many model layers a table row holds (L; each `row_elems / L` wide),
    `resident_layers` how many of the first ones the worker keeps itself (their columns in
    its own memory, never posted: no gather, copy or wait is ever on layer 0's gate), and
    `parts` how many consecutive layers each slot holds, after those; `()` is one slot per
    table, the rest of the row (without resident layers, layout version 1's behaviour).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    architecture: str
    max_tokens: int = Field(gt=0)
    tables: tuple[TableGeometry, ...] = Field(min_length=1)
    row_layers: int = Field(1, gt=0)
    resident_layers: int = Field(0, ge=0)
    parts: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _parts_cover_the_row(self) -> PleGeometry:
        offloaded = self.row_layers - self.resident_layers
        if offloaded < 1:
            raise ValueError(f"{self.resident_layers} resident layers leave none of "
                             f"{self.row_layers} to offload")
        if self.parts and (sum(self.parts) != offloaded or min(self.parts) < 1):
            raise ValueError(f"parts {self.parts} do not split {offloaded} layers")
        for g in self.tables:
            if g.row_elems % self.row_layers:
                raise ValueError(f"{g.name}: {g.row_elems} values per row are not "
                                 f"{self.row_layers} layers")
        return self

    @property
    def table_names(self) -> tuple[str, ...]:
        """The offloaded tables (model modules), one per `tables` entry."""
        return tuple(table.name for table in self.tables)

    @property
    def part_layers(self) -> tuple[int, ...]:
        return self.parts or (self.row_layers - self.resident_layers,)

    def slots(self) -> tuple[SlotGeometry, ...]:
        """Every slot of a pair, in publish order: per table, its parts in layer order."""
        out: list[SlotGeometry] = []
        n = len(self.part_layers)
        for t, g in enumerate(self.tables):
            d = g.row_elems // self.row_layers
            first = self.resident_layers
            for p, k in enumerate(self.part_layers):
                out.append(SlotGeometry(
                    name=slot_name(g.name, p, n), table=g.name, table_index=t,
                    part=p, first_layer=first, num_layers=k, rows=g.rows, row_elems=k * d,
                    col_offset=first * d * ITEMSIZE[g.dtype], dtype=g.dtype))
                first += k
        return tuple(out)

    def slots_of(self, table: str) -> tuple[SlotGeometry, ...]:
        """The slots of one table, one per part, in layer order."""
        return tuple(s for s in self.slots() if s.table == table)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots())


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise PleModelError(f"no config.json in {model_dir}: ray-ple needs a local checkpoint")
    return json.loads(path.read_text())


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    return hf.get("text_config") or hf


def _engine_dtype(hf: dict[str, Any], engine_dtype: str | None) -> DType:
    name = engine_dtype if engine_dtype not in (None, "auto") else (
        _text_config(hf).get("dtype") or _text_config(hf).get("torch_dtype")
        or hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")
    name = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
            "fp32": "float32"}.get(str(name), str(name))
    if name not in ITEMSIZE:
        raise PleModelError(f"unsupported dtype {name!r} for a PLE table")
    return name  # type: ignore[return-value]


def geometry_from_config(
    hf: dict[str, Any], *, max_tokens: int, engine_dtype: str | None = None,
    parts: Parts = 1, resident_layers: int | Literal["auto"] = 0, transport: str = "cpu",
) -> PleGeometry:
    """The offload geometry of a checkpoint, or one clear error if it has no PLE table.

    `resident_layers` (`ple.resident_layers`) first layers stay with the worker ("auto": one
    on the cuda `transport`, none on cpu); `parts` (`ple.parts`) splits the rest of each row
    into slots of consecutive layers. Architectures whose offload class pulls the whole row
    before layer 0 take one part and no resident layers ("auto": one, and none).
    """
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise PleModelError(
            f"architectures {archs} have no PLE table ray-ple can offload "
            f"(supported: {sorted(ARCHITECTURES)})"
        )
    text = _text_config(hf)
    ple_dim = int(text.get("hidden_size_per_layer_input") or 0)
    if ple_dim <= 0:
        raise PleModelError(
            f"{arch} checkpoint has hidden_size_per_layer_input={ple_dim}: no PLE table to offload"
        )
    num_layers = int(text["num_hidden_layers"])
    rows = int(text.get("vocab_size_per_layer_input") or text["vocab_size"])
    shape = TableGeometry(
        name=ARCHITECTURES[arch].module,
        rows=rows,
        row_elems=num_layers * ple_dim,
        dtype=_engine_dtype(hf, engine_dtype),
    )
    if resident_layers == "auto":
        late = ARCHITECTURES[arch].late_waits and num_layers > 1
        resident_layers = 1 if transport == "cuda" and late else 0
    if not 0 <= resident_layers < num_layers:
        raise PleConfigError(f"ple.resident_layers={resident_layers}: {arch} has {num_layers} "
                             f"layers, so 0..{num_layers - 1} (at least one is offloaded)")
    if not ARCHITECTURES[arch].late_waits:
        if resident_layers:
            raise PleConfigError(f"ple.resident_layers={resident_layers}: {arch}'s offload "
                                 "class pulls the whole row before its first layer, so 0")
        # the configured split must fit the row whatever the class; this one takes one part
        if len(split_layers(num_layers, 1 if parts == "auto" else parts)) != 1:
            shown = list(parts) if isinstance(parts, tuple) else parts
            raise PleConfigError(f"ple.parts={shown}: {arch}'s offload class pulls the whole "
                                 "row before its first layer, so one part (1 or auto)")
        parts = 1
    split = split_layers(num_layers - resident_layers, parts, resident_layers)
    return PleGeometry(architecture=arch, max_tokens=max_tokens, tables=(shape,),
                       row_layers=num_layers, resident_layers=resident_layers,
                       parts=split if len(split) > 1 else ())


def safetensors_dtype(code: str) -> DType:
    try:
        return _SAFETENSORS_DTYPE[code]  # type: ignore[return-value]
    except KeyError:
        raise PleModelError(f"PLE table stored as {code}, not a supported float type") from None
