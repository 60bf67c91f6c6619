"""Gemma 3n with images and audio, its PLE table offloaded: vLLM's multimodal class around the
offload text class (`RayPleGemma3nForCausalLM`, gemma3n.py).

vLLM 0.32's `Gemma3nForConditionalGeneration` looks the PLE rows up in `embed_input_ids`,
which the runner calls before the forward, outside the step's transaction: the step's ids as
they are, ids outside `[0, vocab_size_per_layer_input)` (the media tokens) mapped to row 0,
into a persistent buffer its forward hands to the language model. Here `embed_input_ids` keeps
the ids (`ple_ids`, which the runner posts: the offload side reads an id outside the table as
row 0, as vLLM's lookup does) and embeds as vLLM does, and the forward (inside the
transaction) makes the same lookup through the pair, into the same buffer, before vLLM's
forward. The towers, their processor and everything else are vLLM's.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models import gemma3n_mm as vllm_gemma3n_mm
from vllm.model_executor.models.gemma3n_mm import Gemma3nForConditionalGeneration
from vllm.model_executor.models.interfaces import SupportsMultiModal

from ray_ple.errors import PleModelError
from ray_ple.worker.vllm_plugin.gemma3n import RayPleGemma3nForCausalLM
from ray_ple.worker.vllm_plugin.mirror import check_mirrored, language_model_as


class RayPleGemma3nForConditionalGeneration(Gemma3nForConditionalGeneration):
    """vLLM's Gemma 3n media class, its PLE rows pulled from the pair in the forward
    (registered as `ARCHITECTURES["Gemma3nForConditionalGeneration"].media_arch`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_mirrored("vllm.model_executor.models.gemma3n_mm")
        with language_model_as(vllm_gemma3n_mm, "Gemma3nForCausalLM",
                               "RayPleGemma3nForCausalLM"):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not isinstance(self.language_model, RayPleGemma3nForCausalLM):
            raise PleModelError(f"expected RayPleGemma3nForCausalLM, vLLM built "
                                f"{type(self.language_model).__name__}")
        # one buffer of per-layer inputs: the text class's, at a fixed address for graphs
        self.per_layer_embeddings = self.language_model.per_layer_embeddings
        self.register_buffer("ple_ids", torch.zeros(
            vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int32,
            device=self.per_layer_embeddings.device), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: Any = None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's embedding of the step, its ids kept for the forward's lookup (the rows
        are the pair's, pulled inside the step)."""
        self.ple_ids[: input_ids.shape[0]].copy_(input_ids)
        if multimodal_embeddings is None or is_multimodal is None:
            return SupportsMultiModal.embed_input_ids(self, input_ids)
        return SupportsMultiModal.embed_input_ids(self, input_ids, multimodal_embeddings,
                                                  is_multimodal=is_multimodal)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> Any:
        """vLLM's lookup of the step's rows (through the pair), then vLLM's forward."""
        if intermediate_tensors is not None or inputs_embeds is None:
            raise PleModelError("Gemma 3n's media class with PLE offload runs on embeddings, "
                                "on one pipeline stage")
        t, buffer = inputs_embeds.shape[0], self.per_layer_embeddings
        rows = self.language_model.model.get_per_layer_input_embeddings(self.ple_ids[:t])
        buffer[:t].copy_(rows.reshape(t, *buffer.shape[1:]))
        return super().forward(input_ids, positions, None, inputs_embeds, **kwargs)
