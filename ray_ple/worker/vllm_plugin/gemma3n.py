"""Gemma 3n (text) with its per-layer-embedding table offloaded to the offload actor.

vLLM 0.32 reads Gemma 3n's PLE table only in `Gemma3nForConditionalGeneration`: its
`embed_input_ids` looks the ids up (`get_per_layer_input_embeddings`: ids outside
`[0, vocab_size_per_layer_input)` mapped to 0, then the per-layer scale) into a persistent
buffer, and its forward hands that buffer to the text model. vLLM's text-only
`Gemma3nForCausalLM` never passes `per_layer_inputs`, so it runs without the table, unlike
Hugging Face and unlike the multimodal class. This class is the multimodal class's text path:
the same lookup into the same kind of persistent buffer (stable addresses for CUDA graphs),
every call vLLM's own code, with the table's `VocabParallelEmbedding` replaced by
`PleOffloadEmbedding`. Construction sees a one-row placeholder table (the config attribute is
restored at once), so the worker never allocates it; its checkpoint weights are skipped.

A `Gemma3nForConditionalGeneration` checkpoint is served as text through this class: its
text config is the model's, `model.language_model.*` is read as `model.*`, and the towers'
weights are skipped (the architecture is overridden, so vLLM sees no multimodal model). With
images or audio, vLLM's media class builds this class as its language model
(gemma3n_media.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma3n import Gemma3nForCausalLM

from ray_ple.engine_settings import PleEngineSettings
from ray_ple.errors import PleConfigError
from ray_ple.worker.vllm_plugin.attach import attach_worker
from ray_ple.worker.vllm_plugin.embedding import offload_embedding, without_table
from ray_ple.worker.vllm_plugin.mirror import check_mirrored

_SKIP = "embed_tokens_per_layer."
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
           "model.embed_audio.", "model.multi_modal_projector.")
_LANGUAGE_MODEL = "model.language_model."



def _text_only(vllm_config: VllmConfig) -> VllmConfig:
    """The engine config the text model is built from (a multimodal checkpoint's text half)."""
    hf = vllm_config.model_config.hf_config
    text = hf.get_text_config()
    return vllm_config if text is hf else vllm_config.with_hf_config(text)


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, w in weights:
        if _SKIP in name or name.startswith(_TOWERS):
            continue
        if name.startswith(_LANGUAGE_MODEL):
            name = "model." + name[len(_LANGUAGE_MODEL):]
        yield name, w


class RayPleGemma3nForCausalLM(Gemma3nForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_mirrored("vllm.model_executor.models.gemma3n")
        settings = PleEngineSettings.from_additional_config(vllm_config.additional_config)
        (table,) = settings.geometry.tables
        text_vllm_config = _text_only(vllm_config)
        text = text_vllm_config.model_config.hf_config
        if text.num_hidden_layers * text.hidden_size_per_layer_input != table.row_elems:
            raise PleConfigError(f"checkpoint rows have {text.num_hidden_layers} x "
                                 f"{text.hidden_size_per_layer_input} values, the offload "
                                 f"geometry {table.row_elems}")
        with without_table(text, table):
            super().__init__(vllm_config=text_vllm_config, prefix=prefix)
        # named as the table is, "model.", also inside the media class's `language_model`
        self.model.self_decoder.embed_tokens_per_layer = offload_embedding(
            table, "model", vllm_config.model_config.dtype)
        embed = self.model.embed_tokens.weight
        # As vLLM's Gemma3nForConditionalGeneration: one buffer for the forward's whole life,
        # so that a captured graph reads the step's rows at a fixed address.
        self.per_layer_embeddings = torch.zeros(
            vllm_config.scheduler_config.max_num_batched_tokens, text.num_hidden_layers,
            text.hidden_size_per_layer_input, device=embed.device, dtype=embed.dtype)
        attach_worker(vllm_config, settings)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                *args: object, per_layer_inputs: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor:
        if input_ids is None:
            raise PleConfigError("PLE offload needs token ids; prompt embeddings are unsupported")
        if per_layer_inputs is None:
            t, buffer = input_ids.shape[0], self.per_layer_embeddings
            rows = self.model.get_per_layer_input_embeddings(input_ids)
            buffer[:t].copy_(rows.reshape(t, *buffer.shape[1:]))
            per_layer_inputs = buffer[:t]
        return super().forward(input_ids, positions, *args, per_layer_inputs=per_layer_inputs,
                               **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_text_weights(weights))
