"""The package's layout holds: imports run one way, and light entry points stay light.

Layers, lowest first; a module may import its own layer and the ones below, never above:

    base      ray_ple.{base, errors, log, config}, ray_ple.checkpoints.*
    protocol  ray_ple.protocol.*          (imports nothing of ray_ple but base)
    contract  ray_ple.{engine_settings, table_source}   (what the plan hands each side: the
              engine's settings reach the worker, the table's source the offload actor)
    instrument ray_ple.instrument.*       (fault hooks and timestamps the sides call)
    sides     ray_ple.offload.*, ray_ple.worker.*   (never each other)
    plan      ray_ple.supervision.*, ray_ple.engine_plan
    entry     ray_ple.serve.*, ray_ple.offline
    tools     ray_ple.tools.*             (may import anything, lazily where it matters)
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ray_ple"
LAYERS = ["base", "protocol", "contract", "instrument", "sides", "plan", "entry", "tools"]


def layer_of(module: str) -> tuple[int, str]:
    """(rank, room) of a ray_ple module; the room tells the two sides apart."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else ""
    room = {"instrument": "instrument", "protocol": "protocol", "offload": "offload",
            "worker": "worker", "supervision": "supervision", "engine_plan": "supervision",
            "serve": "serve", "offline": "serve", "tools": "tools",
            "engine_settings": "contract", "table_source": "contract"}.get(head, "base")
    name = {"offload": "sides", "worker": "sides", "supervision": "plan", "serve": "entry",
            }.get(room, room)
    return LAYERS.index(name), room


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def ray_ple_imports(path: Path) -> list[tuple[str, int]]:
    """Every `ray_ple` module this file imports (top level, in functions, under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("ray_ple")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("ray_ple"):
                for a in node.names:  # `from ray_ple.instrument import faults` imports a module
                    sub = f"{node.module}.{a.name}"
                    is_mod = (PKG.parent / sub.replace(".", "/")).with_suffix(".py").exists() \
                        or (PKG.parent / sub.replace(".", "/")).is_dir()
                    out.append((sub if is_mod else node.module, node.lineno))
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        my_rank, my_room = layer_of(me)
        for target, line in ray_ple_imports(path):
            rank, room = layer_of(target)
            if rank > my_rank:
                bad.append(f"{me}:{line} ({LAYERS[my_rank]}) imports {target} ({LAYERS[rank]})")
            elif rank == my_rank and LAYERS[rank] == "sides" and room != my_room:
                bad.append(f"{me}:{line} ({my_room} side) imports {target} ({room} side)")
    return bad


def test_imports_run_one_way():
    bad = violations()
    print(f"{sum(1 for _ in PKG.rglob('*.py'))} modules checked, {len(bad)} upward imports")
    assert bad == [], "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself can fail: a protocol module that imports a side is reported."""
    fake = PKG / "protocol" / "_layout_probe.py"
    fake.write_text("from ray_ple.offload.actor import OffloadActor  # noqa: F401\n")
    try:
        assert any("_layout_probe" in v and "offload.actor" in v for v in violations())
    finally:
        fake.unlink()


def readme_map(text: str) -> set[str]:
    """The files the map (docs/layout.md, "The package") names, as paths from the root: each
    row's folder joined with every `name.py` of its other cells."""
    section = text.split("## The package", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        folder = re.fullmatch(r"`(ray_ple/[\w/]*?)(?:\*\.py)?`", cells[0])
        if folder:
            named |= {folder[1] + name for cell in cells[1:]
                      for name in re.findall(r"`([\w/]+\.py)`", cell)}
    return named


def map_mismatch(text: str) -> tuple[list[str], list[str]]:
    """(files of ray_ple/ the map leaves out, files it names that do not exist); a folder's
    `__init__.py` may be left out."""
    on_disk = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")}
    named = readme_map(text)
    return (sorted(f for f in on_disk - named if not f.endswith("/__init__.py")),
            sorted(named - on_disk))


def test_the_map_names_every_file_and_no_other():
    missing, absent = map_mismatch((ROOT / "docs" / "layout.md").read_text())
    assert (missing, absent) == ([], []), f"not in the map: {missing}; no such file: {absent}"


def test_the_map_check_catches_a_file_left_out_and_a_file_gone(tmp_path):
    """The checker itself can fail: a new module the map omits, a name with no file."""
    text = (ROOT / "docs" / "layout.md").read_text().replace(
        "`fatal.py` (`Reason`, the one way down)", "`fatal.py`, `gone.py`")
    fake = PKG / "protocol" / "_map_probe.py"
    fake.write_text("")
    try:
        missing, absent = map_mismatch(text)
    finally:
        fake.unlink()
    assert (missing, absent) == (["ray_ple/protocol/_map_probe.py"], ["ray_ple/protocol/gone.py"])


def test_the_package_docstring_names_every_folder_and_top_level_module():
    import ray_ple

    names = [f"{p.name}/" for p in PKG.iterdir() if (p / "__init__.py").exists()]
    names += [f"`{p.stem}`" for p in PKG.glob("*.py") if p.stem != "__init__"]
    assert [n for n in names if n not in ray_ple.__doc__] == []


def test_top_level_stays_small():
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert len(modules) <= 10, modules


LIGHT = """
import sys
import {module}
heavy = sorted(m for m in sys.modules if m in FORBIDDEN or m.split('.')[0] == 'vllm')
print(heavy)
assert heavy == [], heavy
"""
FORBIDDEN = ("ray_ple.protocol.transaction", "ray_ple.offload.actor", "ray_ple.worker.pair",
             "ray_ple.supervision.supervisor", "ray_ple.protocol.doorbell",
             "ray_ple.offload.gather")


@pytest.mark.parametrize("module", ["ray_ple.tools.k8s.sizing", "ray_ple.tools.cli",
                                    "ray_ple.serve.builder", "ray_ple.engine_plan"])
def test_light_modules_load_no_protocol_core_and_no_vllm(module):
    code = f"FORBIDDEN = {FORBIDDEN!r}\n" + LIGHT.format(module=module)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_worker_cls_names_exist():
    """The engine plan names vLLM's worker classes by string; each must resolve."""
    from ray_ple.engine_plan import WORKER_CLS

    for dotted in WORKER_CLS.values():
        module, _, name = dotted.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type)
