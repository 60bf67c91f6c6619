"""Gemma 4 (text) with its per-layer-embedding table offloaded to the offload actor.

vLLM builds `Gemma4Model.embed_tokens_per_layer` as a `VocabParallelEmbedding` sized by
`vocab_size_per_layer_input`. To never allocate the table in the worker, construction sees
a one-row placeholder table (the config attribute is restored at once, and the model's own
id bound is put back), then the placeholder is replaced by `PleOffloadEmbedding`; the
checkpoint's table weights are skipped at load. Everything else, including the id mapping
and the scale applied after the lookup, is vLLM's code unchanged: outputs stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM, _get_text_config
from vllm.model_executor.models.utils import maybe_prefix

from ray_ple.protocol.engine_settings import PleEngineSettings
from ray_ple.worker.vllm_plugin.attach import attach_worker
from ray_ple.worker.vllm_plugin.layer import offload_embedding, without_table

PLE_WEIGHT = "embed_tokens_per_layer."  # in the name of the checkpoint's table



class RayPleGemma4ForCausalLM(Gemma4ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        settings = PleEngineSettings.from_additional_config(vllm_config.additional_config)
        (layer,) = settings.geometry.layers
        text = _get_text_config(vllm_config.model_config.hf_config)
        with without_table(text, layer):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        offload = offload_embedding(layer, maybe_prefix(prefix, "model"),
                                    vllm_config.model_config.dtype)
        self.model.embed_tokens_per_layer = offload
        self.model.self_decoder.embed_tokens_per_layer = offload
        self.model.vocab_size_per_layer_input = layer.rows
        self.model.self_decoder.vocab_size_per_layer_input = layer.rows
        attach_worker(vllm_config, settings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, w) for n, w in weights if PLE_WEIGHT not in n)
