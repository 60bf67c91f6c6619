"""Gemma 4 with images, video and audio, its PLE table offloaded: vLLM's multimodal class around the
offload text model (`RayPleGemma4ForCausalLM`, gemma4.py).

vLLM 0.32's `Gemma4ForConditionalGeneration` embeds every step outside its language model
(`embed_input_ids`: text rows, the towers' outputs at media positions) and there also looks the
PLE rows up, with media positions mapped to id 0, scaled and stored in a bf16 buffer of
`max_num_batched_tokens x layers x d` that it hands to the language model. Here that lookup is
the pair's: this class keeps the mapped ids on the device (`ple_ids`, which the runner posts
and the resident layers look up), the language model pulls each part's rows at its first
layer's gate, and vLLM's buffer is dropped. The language model stores the scaled rows in
bf16 before its combine, as that buffer holds them (`ple_scaled_rows_stored`: compiled, the
product could otherwise stay fp32). The towers, their processor and everything else are
vLLM's. Tokens equal vLLM's with its buffer (media steps eager, as vLLM runs them, the rest
compiled) at a per-layer scale that is no power of two (sqrt(24)), where rounding the scaled
rows to bf16 or not shows (tests/test_media_offload.py).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models import gemma4_mm as vllm_gemma4_mm
from vllm.model_executor.models.gemma4_mm import Gemma4ForConditionalGeneration

from ray_ple.errors import PleModelError
from ray_ple.worker.vllm_plugin.gemma4 import PleOffloadGemma4Model
from ray_ple.worker.vllm_plugin.mirror import check_mirrored, language_model_as


class RayPleGemma4ForConditionalGeneration(Gemma4ForConditionalGeneration):
    """vLLM's Gemma 4 media class, its PLE rows pulled from the pair (registered as
    `ARCHITECTURES["Gemma4ForConditionalGeneration"].media_arch`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_mirrored("vllm.model_executor.models.gemma4_mm")
        with language_model_as(vllm_gemma4_mm, "Gemma4ForCausalLM", "RayPleGemma4ForCausalLM"):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        model = self.language_model.model
        if not isinstance(model, PleOffloadGemma4Model):
            raise PleModelError(f"expected PleOffloadGemma4Model, vLLM built "
                                f"{type(model).__name__}")
        model.ple_scaled_rows_stored = True  # as vLLM's buffer holds them
        device = next(model.embed_tokens.parameters()).device
        self.per_layer_embeddings = None  # the rows come from the pair
        self.register_buffer("ple_ids", torch.zeros(
            vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int32,
            device=device), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: Any = None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's embedding of the step; its ids, media positions mapped to 0, kept."""
        ids = input_ids if is_multimodal is None else torch.where(
            is_multimodal.to(input_ids.device, non_blocking=True), torch.zeros_like(input_ids),
            input_ids)
        self.ple_ids[: ids.shape[0]].copy_(ids)
        return super().embed_input_ids(input_ids, multimodal_embeddings,
                                       is_multimodal=is_multimodal)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> Any:
        """vLLM's forward, the language model given the step's mapped ids with its
        embeddings (no precomputed per-layer inputs)."""
        if intermediate_tensors is not None or inputs_embeds is None:
            raise PleModelError("Gemma 4's media class with PLE offload runs on embeddings, "
                                "on one pipeline stage")
        self._clear_mm_prefix_for_full_attn_layers()
        return self.language_model.model(self.ple_ids[: inputs_embeds.shape[0]], positions,
                                         intermediate_tensors=None,
                                         inputs_embeds=inputs_embeds, **kwargs)
