"""Worker classes (`ParallelConfig.worker_cls`) whose model runner brackets every forward.

The V1 runner's `_model_forward` ("can be overridden by subclasses") is where a real step is
posted before the forward (by the host, or enqueued for the GPU stream to post) and released
after it; `_dummy_run` (profile, warm-up, capture)
is bracketed as a local forward that never reaches the offload actor.

A multimodal model's forward gets embeddings, not ids (vLLM embeds every step of it
outside the model, `embed_input_ids`): its step posts the ids the media class kept there
(`ple_ids`, media positions as vLLM's per-layer lookup reads them), read by the host on CPU
and by the stream post on CUDA, which needs no host copy of them.
"""

from __future__ import annotations

from typing import Any

from ray_ple.errors import PleConfigError
from ray_ple.worker import pair as worker_pair


class PleRunnerMixin:
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,  # noqa: ANN001
                       inputs_embeds=None, **model_kwargs: Any) -> Any:
        pair = worker_pair.current()
        if pair is None:
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        with self._ple_step(pair, input_ids, inputs_embeds):
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)

    def _ple_step(self, pair: Any, input_ids: Any, inputs_embeds: Any) -> Any:
        """This forward's transaction, posted from the ids its embedding reads."""
        ids = input_ids if input_ids is not None else self._ple_media_ids(inputs_embeds)
        if pair.stream_posts:  # the stream posts the ids it is about to embed (async-safe)
            return pair.stream_step(ids)
        if ids.device.type == "cpu":
            return pair.step(ids.numpy())
        if input_ids is None:
            raise PleConfigError("a media step on the GPU is posted by the stream "
                                 "(ple.post 'auto' or 'stream')")
        # the host copy the runner prepared this batch from (async scheduling is off)
        return pair.step(self.input_ids.cpu[: ids.shape[0]].numpy())

    def _ple_media_ids(self, inputs_embeds: Any) -> Any:
        """The ids the media class kept from vLLM's embedding of this step (`ple_ids`:
        vLLM's own ids for its per-layer lookup, written in stream order before the forward),
        as many as the forward's tokens."""
        kept = getattr(self.get_model(), "ple_ids", None)
        if inputs_embeds is None or kept is None:
            raise PleConfigError("PLE offload needs token ids: prompt embeddings are "
                                 "unsupported")
        return kept[: inputs_embeds.shape[0]]

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        pair = worker_pair.current()
        if pair is None:
            return super()._dummy_run(*args, **kwargs)
        with pair.local_forward():
            return super()._dummy_run(*args, **kwargs)


def with_ple(runner_cls: type) -> type:
    """`runner_cls` with every forward bracketed (the worker classes: `workers_cpu.py`,
    `workers_gpu.py`, one module each, since vLLM's CPU worker module patches
    `torch.cuda`'s stream functions when it is imported and must never load on a GPU)."""
    return type(f"Ple{runner_cls.__name__}", (PleRunnerMixin, runner_cls), {})
