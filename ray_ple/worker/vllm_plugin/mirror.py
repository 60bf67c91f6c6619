"""How the offload classes stand on vLLM's own: the vLLM sources a class mirrors are checked
at construction, and vLLM's media classes build the offload text class as their language
model."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ray_ple.errors import PleModelError


def check_mirrored(expected: dict[str, str], *classes: type) -> None:
    """Fail at construction if a mirrored vLLM method (`"Class.method"` -> sha256 of its
    source, first 16 hex digits; the class among `classes`) is not vLLM 0.32.0's."""
    by_name = {c.__name__: c for c in classes}
    for qualname, digest in expected.items():
        cls, method = qualname.split(".")
        source = inspect.getsource(getattr(by_name[cls], method))
        if hashlib.sha256(source.encode()).hexdigest()[:16] != digest:
            raise PleModelError(f"vLLM's {qualname} differs from the one ray-ple mirrors "
                                f"(vLLM 0.32.0): ray-ple serves it with vLLM 0.32.0 only")


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
