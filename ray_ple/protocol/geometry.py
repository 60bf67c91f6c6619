"""What is offloaded, and its exact shape: derived once from the checkpoint's config.

Both sides of a pair and the supervisor compare these values; a mismatch anywhere is a setup
error, never something to adapt to at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ray_ple.errors import PleModelError

DType = Literal["bfloat16", "float16", "float32"]
ITEMSIZE: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
_SAFETENSORS_DTYPE: dict[str, str] = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class ArchSpec(BaseModel):
    """How one vLLM architecture holds its PLE table."""

    model_config = ConfigDict(frozen=True)
    layer_name: str
    offload_arch: str
    checkpoint_tensors: tuple[str, ...]


# Architectures whose PLE lookup ray-ple replaces (vLLM 0.32 module prefixes).
ARCHITECTURES: dict[str, ArchSpec] = {
    "Gemma4ForCausalLM": ArchSpec(
        layer_name="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma4ForCausalLM",
        checkpoint_tensors=(
            "model.embed_tokens_per_layer.weight",
            "model.language_model.embed_tokens_per_layer.weight",
        ),
    ),
    # The released E2B/E4B checkpoints: served text-only through the same class (vLLM's
    # Gemma4ForCausalLM maps `model.language_model.*` and skips the vision/audio towers).
    "Gemma4ForConditionalGeneration": ArchSpec(
        layer_name="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma4ForCausalLM",
        checkpoint_tensors=("model.language_model.embed_tokens_per_layer.weight",),
    ),
    # vLLM's own text Gemma3nForCausalLM never reads its PLE table (only its multimodal class
    # does); the offload class is that class's text path (worker/vllm_plugin/gemma3n.py).
    "Gemma3nForCausalLM": ArchSpec(
        layer_name="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma3nForCausalLM",
        checkpoint_tensors=(
            "model.embed_tokens_per_layer.weight",
            "model.language_model.embed_tokens_per_layer.weight",
        ),
    ),
    # The released E2B/E4B checkpoints: served text-only, images and audio refused.
    "Gemma3nForConditionalGeneration": ArchSpec(
        layer_name="model.embed_tokens_per_layer",
        offload_arch="RayPleGemma3nForCausalLM",
        checkpoint_tensors=("model.language_model.embed_tokens_per_layer.weight",),
    ),
}


class LayerGeometry(BaseModel):
    """One offloaded table: `rows` x `row_elems` of `dtype`; a token reads one row."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    layer_name: str
    rows: int = Field(gt=0)
    row_elems: int = Field(gt=0)
    dtype: DType

    @property
    def row_bytes(self) -> int:
        return self.row_elems * ITEMSIZE[self.dtype]

    @property
    def table_bytes(self) -> int:
        return self.rows * self.row_bytes


class PleGeometry(BaseModel):
    """Everything both sides must agree on before the first transaction."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    architecture: str
    max_tokens: int = Field(gt=0)
    layers: tuple[LayerGeometry, ...] = Field(min_length=1)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.layer_name for layer in self.layers)


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
    hf: dict[str, Any], *, max_tokens: int, engine_dtype: str | None = None
) -> PleGeometry:
    """The offload geometry of a checkpoint, or one clear error if it has no PLE table."""
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
    layer = LayerGeometry(
        layer_name=ARCHITECTURES[arch].layer_name,
        rows=rows,
        row_elems=num_layers * ple_dim,
        dtype=_engine_dtype(hf, engine_dtype),
    )
    return PleGeometry(architecture=arch, max_tokens=max_tokens, layers=(layer,))


def safetensors_dtype(code: str) -> DType:
    try:
        return _SAFETENSORS_DTYPE[code]  # type: ignore[return-value]
    except KeyError:
        raise PleModelError(f"PLE table stored as {code}, not a supported float type") from None
