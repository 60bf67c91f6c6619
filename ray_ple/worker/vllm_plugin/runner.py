"""Worker classes (`ParallelConfig.worker_cls`) whose model runner brackets every forward.

The V1 runner's `_model_forward` ("can be overridden by subclasses") is where a real step is
posted before the forward (by the host, or enqueued for the GPU stream to post) and released
after it; `_dummy_run` (profile, warm-up, capture)
is bracketed as a local forward that never reaches the offload actor.

A multimodal model's forward gets embeddings, not ids (vLLM embeds every step of it
outside the model): its step is posted from the host's ids with the positions vLLM marked
as media (`_gather_mm_embeddings`, run just before) mapped to id 0, as vLLM maps them
before its per-layer lookup.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from ray_ple.errors import PleConfigError
from ray_ple.worker import pair as worker_pair


class PleRunnerMixin:
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,  # noqa: ANN001
                       inputs_embeds=None, **model_kwargs: Any) -> Any:
        pair = worker_pair.current()
        if pair is None:
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        if input_ids is None:  # a multimodal model's step
            with pair.step(self._ple_media_ids(pair, inputs_embeds)):
                return super()._model_forward(input_ids, positions, intermediate_tensors,
                                              inputs_embeds, **model_kwargs)
        if pair.stream_posts:  # the stream posts the ids it is about to embed (async-safe)
            with pair.stream_step(input_ids):
                return super()._model_forward(input_ids, positions, intermediate_tensors,
                                              inputs_embeds, **model_kwargs)
        if input_ids.device.type == "cpu":
            host = input_ids.numpy()
        else:  # the host copy the runner prepared this batch from (async scheduling is off)
            host = self.input_ids.cpu[: input_ids.shape[0]].numpy()
        with pair.step(host):
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)

    def _gather_mm_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        mm_embeds, is_mm_embed = super()._gather_mm_embeddings(*args, **kwargs)
        self._ple_media = is_mm_embed  # a CPU bool per scheduled token
        return mm_embeds, is_mm_embed

    def _ple_media_ids(self, pair: Any, inputs_embeds: Any) -> np.ndarray:
        """The host's ids of this step, media positions mapped to 0; each step's media mask
        is used once."""
        media, self._ple_media = getattr(self, "_ple_media", None), None
        if inputs_embeds is None or media is None or pair.stream_posts:
            raise PleConfigError("PLE offload needs token ids: prompt embeddings are "
                                 "unsupported, and media steps are posted by the host")
        n = int(inputs_embeds.shape[0])
        if media.shape[0] > n:
            raise PleConfigError(f"the step's media mask covers {media.shape[0]} tokens, "
                                 f"its forward {n}")
        ids = self.input_ids.cpu[:n].numpy().copy()
        ids[: media.shape[0]][media.numpy()] = 0
        return ids

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        pair = worker_pair.current()
        if pair is None:
            return super()._dummy_run(*args, **kwargs)
        with pair.local_forward():
            return super()._dummy_run(*args, **kwargs)


def _with_ple(runner_cls: type) -> type:
    return type(f"Ple{runner_cls.__name__}", (PleRunnerMixin, runner_cls), {})


class PleCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise PleConfigError("PLE offload needs vLLM's V1 model runner "
                                 "(VLLM_USE_V2_MODEL_RUNNER=0)")
        # CPUWorker builds its runner inline (no factory): give it the bracketing subclass.
        self.model_runner.__class__ = _with_ple(type(self.model_runner))


class PleGPUWorker(Worker):
    def _make_model_runner(self):  # noqa: ANN202 - vLLM's GPUModelRunner
        if self.use_v2_model_runner:
            raise PleConfigError("PLE offload needs vLLM's V1 model runner "
                                 "(VLLM_USE_V2_MODEL_RUNNER=0)")
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return _with_ple(GPUModelRunner)(self.vllm_config, self.device)

