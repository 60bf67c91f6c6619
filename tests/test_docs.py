"""The docs say what the code does now: the `ple:` tables are generated from `PleConfig` and
the served table from `protocol/support.py`, and every repository path, relative link and
`ple.` option the front docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.doc_tables import DOCS, render, rows

ROOT = Path(__file__).resolve().parent.parent
# the pages a user reads (history.md and mutation.md record past states; results are runs)
FRONT = [ROOT / "README.md", ROOT / "k8s" / "README.md", ROOT / "bench" / "README.md",
         *(p for p in sorted((ROOT / "docs").glob("*.md"))
           if p.name not in ("history.md", "mutation.md"))]
TOP = ("ray_ple", "serve_configs", "tests", "scripts", "bench", "docs", "k8s", "dashboards")
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOP)})/[\w./-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OPTION = re.compile(r"(?<![\w/.-])ple\.([a-z_]+(?:\.[a-z_]+)?)")


def keys() -> set[str]:
    from ray_ple.config import PleConfig

    leaves = {key for key, _, _ in rows(PleConfig)}
    return leaves | {k.split(".")[0] for k in leaves}


def named(pattern: re.Pattern[str], text: str) -> list[str]:
    """What `pattern` names in `text`; templates (`results/serve-run{14,16}`, `<run>`) left
    out."""
    return [m[1] for m in pattern.finditer(text) if text[m.end():m.end() + 1] not in "{<"]


@pytest.mark.parametrize("doc", sorted(set(DOCS.values())), ids=lambda p: p.name)
def test_the_generated_tables_are_current(doc: Path) -> None:
    text = doc.read_text()
    assert render(doc, text) == text, "run: python scripts/doc_tables.py --write"


def test_every_ple_key_and_every_architecture_has_its_row() -> None:
    from ray_ple.protocol.geometry import ARCHITECTURES

    config, models = DOCS["main"].read_text(), DOCS["support"].read_text()
    for key in keys() - {"deadlines", "supervisor"}:
        assert f"| `{key}` |" in config, key
    for arch in ARCHITECTURES:
        assert f"| `{arch}` | text" in models, arch


def test_a_stale_table_is_found() -> None:
    """The check can fail: a row removed, or a description changed by hand."""
    doc = DOCS["main"]
    text = doc.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| `shm_dir` |"))
    for stale in (text.replace(row + "\n", ""), text.replace(row, row.replace("tmpfs", "a"))):
        assert stale != text and render(doc, stale) == text


@pytest.mark.parametrize("page", FRONT, ids=[str(p.relative_to(ROOT)) for p in FRONT])
def test_the_paths_links_and_options_a_page_names_exist(page: Path) -> None:
    # the package map names files from its rows' folders (tests/test_layout.py checks those)
    text = "\n".join(ln for ln in page.read_text().splitlines()
                     if not ln.startswith("| `ray_ple/"))
    gone = [p for p in named(PATH, text) if "*" not in p and not (ROOT / p).exists()]
    dead = [ln for ln in named(LINK, text) if "://" not in ln
            and not (page.parent / ln).resolve().exists()]
    unknown = [o for o in named(OPTION, text) if o != "yaml" and o not in keys()]
    assert (gone, dead, unknown) == ([], [], [])


def test_the_checks_find_a_path_a_link_and_an_option_that_do_not_exist() -> None:
    text = "see `ray_ple/gone.py`, [x](gone.md) and ple.nothing; ple.parts is real"
    assert [p for p in named(PATH, text) if not (ROOT / p).exists()] == ["ray_ple/gone.py"]
    assert named(LINK, text) == ["gone.md"]
    assert [o for o in named(OPTION, text) if o not in keys()] == ["nothing"]
