"""`ray-ple check SERVE.yaml`: would `serve run` accept this config, and can this node hold it?

Runs the validation `build_app` runs (`ray_ple.serve.builder.check_app`: the `ple:` block,
the refusals, the engine settings ray-ple sets, the checkpoint's config), then opens each
checkpoint's PLE tensor as the offload actor will (name, shape, dtype, bytes), and sets the
table and pair segments against this node's /dev/shm and memory (`ray-ple doctor`'s
checks). Ray is not started: it loads Ray Serve LLM's config classes only.

Exit 0: one line per model, then the node's checks. Exit 1: a bad config is one line on
stderr, the exact error text `serve run` would give; a node check that fails is its FAIL
line. `--no-checkpoint` validates what needs no checkpoint (a config meant for other
machines, as the k8s renderer does) and skips the table and node checks.
"""

from __future__ import annotations

import contextlib
import io
import sys

from ray_ple.errors import PleError
from ray_ple.tools.doctor import (
    DoctorArgs,
    check_host_memory,
    check_shm,
    config_needs,
    node_args,
)


def main(path: str, *, read_checkpoint: bool = True, shm_dir: str | None = None) -> int:
    """`shm_dir` overrides the models' `ple.shm_dir` (each directory is checked for the
    segments of the models that use it)."""
    # what the libraries print while they load (vLLM's Triton notes) is held back: a bad
    # config's stderr is its one error line; a good one's is replayed
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            needs = config_needs(path, read_checkpoint=read_checkpoint)
    except PleError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    sys.stderr.write(held.getvalue())
    if not read_checkpoint:
        print(f"ok {path}: valid for build_app; checkpoints not read (--no-checkpoint), so "
              "no table or node check", flush=True)
        return 0
    for n in needs:
        print(n.line(), flush=True)
    if not needs:
        print(f"ok {path}: valid for build_app; no model is offloaded", flush=True)
        return 0
    by_dir: dict[str, list] = {}
    for n in needs:
        by_dir.setdefault(shm_dir or n.shm_dir, []).append(n)
    checks = [check_shm(node_args(group, DoctorArgs(shm_dir=d))) for d, group in by_dir.items()]
    checks.append(check_host_memory(node_args(needs, DoctorArgs())))
    for c in checks:
        print(c.line(), flush=True)
    if any(c.status == "FAIL" for c in checks):
        return 1
    print(f"ok {path}", flush=True)
    return 0
