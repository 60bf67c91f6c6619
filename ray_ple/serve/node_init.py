"""Ray Serve LLM's node initialisation, skipped where it has nothing to fetch.

Before the engine starts, Ray Serve LLM runs one task per node of the replica's placement group
to download the model. Without a cloud mirror that task returns the model id unchanged (a local
checkpoint, or a Hugging Face id that vLLM itself fetches), yet it starts a fresh Ray worker
with the replica's runtime env on every node: 10-17 s of a replica's cold start on a 2-core
machine, on every start and every restart after a verdict. An offloaded model's checkpoint is
always local (the builder reads its geometry from it), so the builder installs this callback,
unless the user configured their own.
"""

from __future__ import annotations

import os

from ray.llm._internal.common.callbacks.base import CallbackBase

from ray_ple.log import log_event

CALLBACK_CLS = "ray_ple.serve.node_init:LocalModelNodeInit"


class LocalModelNodeInit(CallbackBase):
    """Skips the per-node download tasks when no mirror is configured (they would be no-ops)."""

    async def on_before_node_init(self) -> None:
        engine_config = self.llm_config.get_engine_config()
        if engine_config.mirror_config is not None:
            return  # a real download: Ray Serve LLM's own tasks run as usual
        import torch

        # the one side effect of the skipped task (a workaround in Ray Serve LLM for torch
        # failing to create its kernels cache when the parent is missing), on this node
        os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
        self.ctx.run_init_node = False
        log_event("node_init_skipped", model=engine_config.actual_hf_model_id,
                  why="no mirror configured: the download tasks would return the id unchanged")
