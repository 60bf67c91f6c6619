"""The GPU worker class (`ParallelConfig.worker_cls` on the cuda transport)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from ray_ple.errors import PleConfigError
from ray_ple.worker.vllm_plugin.mirror import check_mirrored
from ray_ple.worker.vllm_plugin.runner import with_ple


class PleGPUWorker(Worker):
    def _make_model_runner(self):  # noqa: ANN202 - vLLM's GPUModelRunner
        check_mirrored("vllm.v1.worker.gpu_worker")
        check_mirrored("vllm.v1.worker.gpu_model_runner")
        if self.use_v2_model_runner:
            raise PleConfigError("PLE offload needs vLLM's V1 model runner "
                                 "(VLLM_USE_V2_MODEL_RUNNER=0)")
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return with_ple(GPUModelRunner)(self.vllm_config, self.device)

