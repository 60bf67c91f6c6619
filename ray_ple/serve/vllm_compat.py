"""Ray Serve LLM 2.60 on vLLM 0.33: one module that moved.

Ray Serve LLM 2.60 imports `FrontendArgs` from `vllm.entrypoints.launchers.cli_args` (vLLM
0.32); vLLM 0.33 moved that module to `vllm.entrypoints.common.cli_args`, unchanged. Where the
old name does not import, it is made an alias of the new module, before Ray Serve LLM's
engine modules import (the `ray_ple.serve` package does this first, in every process that
imports it: the driver that builds the app and each replica).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

OLD = "vllm.entrypoints.launchers.cli_args"
NEW = "vllm.entrypoints.common.cli_args"


def _in_vllm(module: str) -> bool:
    """Whether the installed vLLM has `module`'s file (looked up, nothing imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    rel = Path(*module.split(".")[1:]).with_suffix(".py")
    return any((Path(d) / rel).is_file() for d in spec.submodule_search_locations)


def alias_frontend_args() -> str:
    """The module Ray Serve LLM's `FrontendArgs` import resolves to (OLD or NEW). vLLM is
    imported only where the alias is needed (vLLM 0.33)."""
    if _in_vllm(OLD) or not _in_vllm(NEW):  # 0.32, or no vLLM: the version check names it
        return OLD
    sys.modules[OLD] = importlib.import_module(NEW)
    return NEW
