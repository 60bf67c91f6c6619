"""Gemma 4 (text) with its per-layer-embedding table offloaded to the offload actor.

vLLM builds `Gemma4Model.embed_tokens_per_layer` as a `VocabParallelEmbedding` sized by
`vocab_size_per_layer_input`. To never allocate the table in the worker, construction sees
a one-row placeholder table (the config attribute is restored at once, and the model's own
id bound is put back), then the placeholder is replaced by `PleOffloadEmbedding`; the
checkpoint's table weights are skipped at load. Everything else, including the id mapping
and the scale applied after the lookup, is vLLM's code unchanged: outputs stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM, _get_text_config
from vllm.model_executor.models.utils import maybe_prefix

from ray_ple.errors import PleConfigError, PleHandleError
from ray_ple.protocol.engine_settings import PleEngineSettings
from ray_ple.worker.vllm_plugin.attach import attach_worker
from ray_ple.worker.vllm_plugin.layer import PleOffloadEmbedding

_SKIP = "embed_tokens_per_layer."


@contextmanager
def _placeholder_table(text_config) -> Iterator[None]:  # noqa: ANN001 - HF config
    real = text_config.vocab_size_per_layer_input
    text_config.vocab_size_per_layer_input = 1
    try:
        yield
    finally:
        text_config.vocab_size_per_layer_input = real


class RayPleGemma4ForCausalLM(Gemma4ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        settings = PleEngineSettings.from_additional_config(vllm_config.additional_config)
        (layer,) = settings.geometry.layers
        text = _get_text_config(vllm_config.model_config.hf_config)
        if text.vocab_size_per_layer_input != layer.rows:
            raise PleConfigError(f"checkpoint has {text.vocab_size_per_layer_input} PLE rows, "
                                 f"the offload geometry {layer.rows}")
        with _placeholder_table(text):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        name = f"{maybe_prefix(prefix, 'model')}.embed_tokens_per_layer"
        if name != layer.layer_name:
            raise PleHandleError(f"model's PLE layer is {name!r}, handles name "
                                 f"{layer.layer_name!r}")
        dtype = vllm_config.model_config.dtype
        if dtype != getattr(torch, layer.dtype):
            raise PleConfigError(f"engine dtype {dtype} differs from the offloaded table's "
                                 f"{layer.dtype}")
        offload = PleOffloadEmbedding(layer.layer_name, layer.row_elems, dtype)
        self.model.embed_tokens_per_layer = offload
        self.model.self_decoder.embed_tokens_per_layer = offload
        self.model.vocab_size_per_layer_input = layer.rows
        self.model.self_decoder.vocab_size_per_layer_input = layer.rows
        attach_worker(vllm_config, settings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, w) for n, w in weights if _SKIP not in n)
