"""This tree's code measured beside another revision's (`--against REV` of the CPU benches).

REV is checked out in a temporary `git worktree`; each measurement runs in a fresh
interpreter with the tree under test first on its path, and rounds alternate the order of
the trees, so that what else runs on a shared machine falls on both alike.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def trees(against: str | None) -> Iterator[dict[str, Path]]:
    """`{"this": ROOT}`, and with `against` that revision's tree too (removed afterwards)."""
    if not against:
        yield {"this": ROOT}
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-against-"))
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                        str(tmp / "tree"), against], check=True)
        yield {"this": ROOT, against: tmp / "tree"}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(tmp / "tree")], check=False, capture_output=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def in_order(names: list[str], round_: int) -> list[str]:
    """The trees of round `round_`: as given on even rounds, reversed on odd ones."""
    return names if round_ % 2 == 0 else names[::-1]


def measure_in(tree: Path, module: str, call: str) -> Any:
    """`module.<call>` in a fresh interpreter importing ray_ple from `tree`; its JSON result."""
    code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); "
            f"sys.path.insert(1, {str(ROOT / 'bench' / 'cpu')!r}); import {module}; "
            f"print(json.dumps({module}.{call}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if res.returncode:
        sys.exit(f"{module}: measuring {tree} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
