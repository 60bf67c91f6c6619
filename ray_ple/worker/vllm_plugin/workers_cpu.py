"""The vLLM-CPU worker class (`ParallelConfig.worker_cls` on the cpu transport).

Its own module: vLLM's CPU worker module replaces `torch.cuda`'s stream functions with
placeholders when it is imported, so it must never be imported in a GPU worker.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from ray_ple.errors import PleConfigError
from ray_ple.worker.vllm_plugin.mirror import check_mirrored
from ray_ple.worker.vllm_plugin.runner import with_ple


class PleCPUWorker(CPUWorker):
    def init_device(self) -> None:
        check_mirrored("vllm.v1.worker.gpu_model_runner")  # CPUModelRunner's hooked methods
        super().init_device()
        if self.use_v2_model_runner:
            raise PleConfigError("PLE offload needs vLLM's V1 model runner "
                                 "(VLLM_USE_V2_MODEL_RUNNER=0)")
        # CPUWorker builds its runner inline (no factory): give it the bracketing subclass.
        self.model_runner.__class__ = with_ple(type(self.model_runner))
