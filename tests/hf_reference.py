"""Hugging Face transformers as the independent oracle for greedy tokens.

vLLM maps token ids outside `[0, vocab_size_per_layer_input)` to 0 before the PLE lookup;
HF's Gemma 4 indexes the table directly, so the reference applies the same mapping first.
Random tiny models have near-flat logits: top logits can tie exactly in bf16, or differ by
one or two bf16 ulps, where HF's and vLLM's kernels (different reduction orders) may rank
them differently. The check therefore decodes incrementally in HF with the candidate's
tokens and requires each one to be HF's argmax, or within 2 bf16 ulps of HF's maximum (a
near-tie, counted and returned so that a test can bound how often it happens).
"""

from __future__ import annotations

import math

import torch


def _load_gemma3n(model_dir: str):  # noqa: ANN202
    """HF's text Gemma 3n indexes its PLE table directly too; the same mapping goes first."""
    from transformers import Gemma3nForCausalLM

    model = Gemma3nForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    text, rows = model.model, model.config.vocab_size_per_layer_input
    original = text.get_per_layer_inputs
    text.get_per_layer_inputs = lambda ids: original(  # noqa: E731
        torch.where((ids >= 0) & (ids < rows), ids, 0))
    return model


def _load(model_dir: str):  # noqa: ANN202
    from transformers import AutoConfig, Gemma4ForCausalLM

    if AutoConfig.from_pretrained(model_dir).model_type == "gemma3n_text":
        return _load_gemma3n(model_dir)

    model = Gemma4ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    text, rows = model.model, model.config.vocab_size_per_layer_input
    original = text.get_per_layer_inputs

    def mapped(input_ids, inputs_embeds):  # noqa: ANN001, ANN202
        if input_ids is not None:
            input_ids = torch.where((input_ids >= 0) & (input_ids < rows), input_ids, 0)
        return original(input_ids, inputs_embeds)

    text.get_per_layer_inputs = mapped
    return model


def hf_agrees(model_dir: str, prompts: list[list[int]],
              candidates: list[list[int]], ulps: int = 2) -> tuple[list[str], int]:
    """(disagreements, ties): each candidate token must be HF's greedy choice at its step."""
    model = _load(model_dir)
    problems, ties = [], 0
    with torch.no_grad():
        for n, (prompt, tokens) in enumerate(zip(prompts, candidates)):
            ids, past = torch.tensor([prompt]), None
            for step, tok in enumerate(tokens):
                out = model(ids, past_key_values=past, use_cache=True)
                logits, past = out.logits[0, -1].float(), out.past_key_values
                best = float(logits.max())
                ulp = 2.0 ** (math.floor(math.log2(abs(best) or 1.0)) - 7)
                if float(logits[tok]) < best - ulps * ulp:
                    problems.append(f"prompt {n} step {step}: got {tok} "
                                    f"({float(logits[tok]):.5f}), HF argmax "
                                    f"{int(logits.argmax())} ({best:.5f})")
                    break
                ties += float(logits[tok]) != best or int((logits == best).sum()) > 1
                ids = torch.tensor([[tok]])
    return problems, ties
