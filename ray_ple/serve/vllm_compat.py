"""Ray Serve LLM 2.60 on vLLM 0.33: one module that moved.

Ray Serve LLM 2.60 imports `FrontendArgs` from `vllm.entrypoints.launchers.cli_args` (vLLM
0.32); vLLM 0.33 moved that module to `vllm.entrypoints.common.cli_args`, unchanged. Where the
old name does not import, it is made an alias of the new module, before Ray Serve LLM's
engine modules import (the `ray_ple.serve` package does this first, in every process that
imports it: the driver that builds the app and each replica).
"""

from __future__ import annotations

import importlib
import sys

OLD = "vllm.entrypoints.launchers.cli_args"
NEW = "vllm.entrypoints.common.cli_args"


def alias_frontend_args() -> str:
    """The module Ray Serve LLM's `FrontendArgs` import resolves to (OLD or NEW)."""
    try:
        importlib.import_module(OLD)
        return OLD
    except ImportError:
        pass
    try:
        module = importlib.import_module(NEW)
    except ImportError:  # neither: vLLM is missing or other; the version check names it
        return OLD
    sys.modules[OLD] = module
    return NEW
