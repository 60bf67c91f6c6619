"""Ray Serve integration: `import_path: ray_ple.serve:build_app` in a `serve run` config."""

from ray_ple.serve.vllm_compat import alias_frontend_args

alias_frontend_args()  # before Ray Serve LLM's engine modules import (vLLM 0.33)

from ray_ple.serve.builder import build_app  # noqa: E402

__all__ = ["build_app"]
