"""Ray Serve integration: `import_path: ray_ple.serve:build_app` in a `serve run` config."""

from ray_ple.serve.builder import build_app

__all__ = ["build_app"]
