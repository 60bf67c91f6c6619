"""The unoffloaded Gemma 3n reference: vLLM's own PLE lookup, the table in the worker.

vLLM 0.32 computes Gemma 3n's per-layer inputs only in `Gemma3nForConditionalGeneration`
(`embed_input_ids` into a persistent buffer, then the text model's forward), and that class
cannot be built here (its vision tower needs timm). Its text path, transcribed on vLLM's own
`Gemma3nForCausalLM` with vLLM's own table, is the unoffloaded model the offload must match
bit for bit. vLLM's plain `Gemma3nForCausalLM` passes no `per_layer_inputs` at all.

`python -m tests.gemma3n_reference '<json job>'` is `tests.engine_job` with this class
registered; the engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
registration reaches the worker.
"""

from __future__ import annotations

import runpy

import torch
from vllm.model_executor.models.gemma3n import Gemma3nForCausalLM

ARCH = "Gemma3nTextPleReference"


class Gemma3nTextPleReference(Gemma3nForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:  # noqa: ANN001
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = vllm_config.model_config.hf_config
        weight = self.model.embed_tokens.weight
        self.per_layer_embeddings = torch.zeros(
            vllm_config.scheduler_config.max_num_batched_tokens, cfg.num_hidden_layers,
            cfg.hidden_size_per_layer_input, device=weight.device, dtype=weight.dtype)

    def forward(self, input_ids, positions, *args, per_layer_inputs=None, **kwargs):  # noqa: ANN001, ANN201
        rows = self.model.get_per_layer_input_embeddings(input_ids)
        rows = rows.reshape(-1, *self.per_layer_embeddings.shape[1:])
        self.per_layer_embeddings[: rows.shape[0]].copy_(rows)
        return super().forward(input_ids, positions, *args,
                               per_layer_inputs=self.per_layer_embeddings[: rows.shape[0]],
                               **kwargs)


if __name__ == "__main__":
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCH, f"tests.gemma3n_reference:{ARCH}")
    runpy.run_module("tests.engine_job", run_name="__main__")
