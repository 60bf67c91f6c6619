"""Where vLLM's own GPU runner can run: its CUDA build and a GPU (the tests that need them)."""

from __future__ import annotations

import importlib.util

import pytest


def vllm_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def needs_vllm_cuda(stage: str) -> pytest.MarkDecorator:
    """Skip where vLLM's CUDA build or a GPU is missing, naming the device stage that runs it."""
    return pytest.mark.skipif(not vllm_cuda(), reason=(
        f"needs a CUDA GPU and vLLM's CUDA build; scripts/gpu_device_run.sh {stage} runs this "
        "module on the GPU machine"))
