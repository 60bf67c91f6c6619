"""`ray-ple`: operator commands.

    ray-ple check SERVE.yaml      would `serve run` accept it, can this node hold it (no Ray)
    ray-ple doctor [...]          can this pod hold what ray-ple will ask of it (k8s init step)
    ray-ple render-k8s [--check]  write (or compare) k8s/*.yaml and k8s/README.md's sizing
    ray-ple ready [-n APP]        wait until a Serve application can serve (token auth as set)

Each subcommand imports its module only when run: `doctor` must stay light and CUDA-free.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ray_ple.tools.quantity import parse_bytes


def _doctor(ns: argparse.Namespace) -> int:
    from ray_ple.tools.doctor import DoctorArgs, main

    return main(DoctorArgs(
        transport=ns.transport, table_bytes=ns.table_bytes, pair_bytes=ns.pair_bytes,
        workers=ns.workers, object_store_bytes=ns.object_store_bytes,
        shm_headroom_bytes=ns.shm_headroom_bytes, shm_dir=ns.shm_dir,
        checkpoint=ns.checkpoint, dtype=ns.dtype, config=ns.config))


def _check(ns: argparse.Namespace) -> int:
    from ray_ple.tools.check import main

    return main(ns.config, read_checkpoint=not ns.no_checkpoint, shm_dir=ns.shm_dir)


def _ready(ns: argparse.Namespace) -> int:
    from ray_ple.tools.ready import main

    return main(ns.name, ns.address, ns.timeout, ns.interval)


def _render_k8s(ns: argparse.Namespace) -> int:
    from ray_ple.errors import PleConfigError
    from ray_ple.tools.k8s.render import find_root, write_or_check

    try:
        root = find_root(None if ns.root is None else Path(ns.root))
        stale = write_or_check(root, check=ns.check)
    except PleConfigError as e:
        print(f"ray-ple render-k8s: {e}", file=sys.stderr)
        return 2
    for path in stale:
        print(f"{'differs' if ns.check else 'wrote'}: {path}")
    if ns.check and stale:
        print(f"run `ray-ple render-k8s` in {root} and commit the result", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ray-ple", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="validate a serve config as build_app does, without Ray; "
                       "exit 1 with serve run's error")
    c.add_argument("config", help="a `serve run` config (an application of "
                   "ray_ple.serve:build_app)")
    c.add_argument("--no-checkpoint", action="store_true",
                   help="checkpoints live elsewhere: validate what needs none; no table or "
                   "node check")
    c.add_argument("--shm-dir", default=None, help="check this directory instead of each "
                   "model's ple.shm_dir")
    c.set_defaults(run=_check)

    d = sub.add_parser("doctor", help="preflight checks, one line each; exit 1 on FAIL")
    d.add_argument("--transport", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda where a GPU is visible")
    for flag, what in (("--table-bytes", "the node table's segment"),
                       ("--pair-bytes", "one worker's pair segment"),
                       ("--object-store-bytes", "Ray's object store in /dev/shm"),
                       ("--shm-headroom-bytes", "/dev/shm for vLLM, torch, NCCL")):
        d.add_argument(flag, type=parse_bytes, default=0, help=f"{what} (bytes or 5Gi)")
    d.add_argument("--workers", type=int, default=1, help="engine workers in this pod")
    d.add_argument("--shm-dir", default="/dev/shm")
    d.add_argument("--checkpoint", help="check its table against --table-bytes")
    d.add_argument("--dtype", help="engine dtype, for --checkpoint")
    d.add_argument("--config", help="a `serve run` config: every figure from it, as the server "
                   "computes them (this node holds all its replicas)")
    d.set_defaults(run=_doctor)

    w = sub.add_parser("ready", help="wait until a Serve application is RUNNING (exit 0), "
                       "failed (1) or the timeout passed (124)")
    w.add_argument("-n", "--name", default="ple", help="the application's name")
    w.add_argument("--address", default="http://127.0.0.1:8265", help="Ray's dashboard")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between looks")
    w.set_defaults(run=_ready)

    r = sub.add_parser("render-k8s", help="k8s/*.yaml from k8s/spec/clusters.yaml + serve_configs/")
    r.add_argument("--root", help="project root (default: the checkout holding the current "
                   "directory, else the one ray_ple is installed from)")
    r.add_argument("--check", action="store_true",
                   help="compare only; exit 1 if a manifest or k8s/README.md's sizing is stale")
    r.set_defaults(run=_render_k8s)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    return ns.run(ns)


if __name__ == "__main__":
    sys.exit(main())
