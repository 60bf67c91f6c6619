"""How the offload classes stand on vLLM's own: the vLLM sources they mirror or hook are
checked when they are built, and vLLM's media classes build the offload text class as their
language model.

`MIRRORED` is every vLLM method ray-ple's code depends on line by line: the model methods the
offload classes mirror or call into, and the runner methods the worker hooks. Each is the
sha256 (first 16 hex digits) of its source as it stands in the file, decorators included; the
same in every vLLM version of `TESTED_VLLM` (tests/test_vllm_versions.py reads each version's
wheel). A source that differs is refused when the class is built, never run as if it were
the one ray-ple was written against.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from ray_ple.errors import PleEnvironmentError, PleModelError

TESTED_VLLM = ("0.32", "0.33")
MIRRORED: dict[str, dict[str, str]] = {
    "vllm.model_executor.models.gemma4": {
        "Gemma4DecoderLayer.forward": "7cd0b990b419b392",
        "Gemma4Model.forward": "4462a1c4d8732679",
        "Gemma4SelfDecoderLayers.project_per_layer_inputs": "1e31659e1ea7f8ca"},
    "vllm.model_executor.models.gemma4_mm": {
        "Gemma4ForConditionalGeneration.embed_input_ids": "29801fc919052b60",
        "Gemma4ForConditionalGeneration.forward": "93464c877f0485fd"},
    "vllm.model_executor.models.gemma3n": {
        "Gemma3nForCausalLM.forward": "f35f668d06c3a8f9",
        "Gemma3nTextModel.get_per_layer_input_embeddings": "4aaf9cbb295ece15",
        "Gemma3nSelfDecoder.get_per_layer_input_embeddings": "5ea6ced0243a15d8"},
    "vllm.model_executor.models.gemma3n_mm": {
        "Gemma3nForConditionalGeneration.embed_input_ids": "eee0baede374feef",
        "Gemma3nForConditionalGeneration.forward": "ac745b464b3595d6"},
    "vllm.v1.worker.gpu_model_runner": {  # the runner hooks (runner.py)
        "GPUModelRunner._model_forward": "a8f98588a4656ef6",
        "GPUModelRunner._dummy_run": "47b96b71fc654516"},
    "vllm.v1.worker.gpu_worker": {
        "Worker._make_model_runner": "3817214704e1e262"},
}


def method_digest(source: str, qualname: str) -> str | None:
    """sha256 (16 hex digits) of `Class.method`'s lines in a module's source, or None."""
    cls, method = qualname.split(".")
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == method:
                    first = min([d.lineno for d in f.decorator_list] + [f.lineno])
                    text = "".join(lines[first - 1:f.end_lineno])
                    return hashlib.sha256(text.encode()).hexdigest()[:16]
    return None


def source_digests(module: str, source: str) -> dict[str, str | None]:
    """Each mirrored method of `module` -> its digest in `source` (a version's file)."""
    return {q: method_digest(source, q) for q in MIRRORED[module]}


def check_vllm_version(version: str) -> None:
    """One clear error for a vLLM release ray-ple was not checked against."""
    if not version.startswith(tuple(v + "." for v in TESTED_VLLM)):
        raise PleEnvironmentError(f"ray-ple serves with vLLM {' and '.join(TESTED_VLLM)} (the "
                            f"sources its model classes and runner hooks were checked "
                            f"against), not vLLM {version}: install vllm>=0.32,<0.34")


def check_mirrored(module: str) -> None:
    """Fail when a class is built if a mirrored method of the imported vLLM `module` is not
    the one ray-ple was written against."""
    spec = importlib.util.find_spec(module)  # the file the module is (or would be) read from
    path = Path(spec.origin if spec and spec.origin else "")
    got = source_digests(module, path.read_text())
    for qualname, digest in MIRRORED[module].items():
        if got[qualname] != digest:
            raise PleModelError(f"vLLM's {qualname} ({module}) differs from the one ray-ple "
                                f"mirrors: ray-ple serves vLLM {' and '.join(TESTED_VLLM)}, "
                                "whose sources it was checked against")


@contextmanager
def language_model_as(module: ModuleType, text_arch: str, offload_arch: str) -> Iterator[None]:
    """Let the media class of `module` build `offload_arch` where it asks for `text_arch`
    as its `language_model`."""
    saved = module.init_vllm_registered_model

    def build(*args: Any, architectures: list[str] | None = None, **kwargs: Any) -> Any:
        if architectures != [text_arch]:
            raise PleModelError(f"vLLM's media class asked for {architectures} as its "
                                f"language model, not {text_arch}")
        return saved(*args, architectures=[offload_arch], **kwargs)

    module.init_vllm_registered_model = build
    try:
        yield
    finally:
        module.init_vllm_registered_model = saved
