"""bench/README.md is the index of the figures the docs state: every script and results folder it
names exists, every results folder in the tree is one it names (results behind no figure go
to git history), and run names stay in results folders, out of the code and the README."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = re.compile(r"\b((late|serve|stepcpu|post)-?run\d+|run\d+)")
RESULTS_PATH = re.compile(r"results/[\w.-]+")


def index_rows(root: Path) -> list[list[str]]:
    """The cells of bench/README.md's table, one list per row (header and rule left out)."""
    lines = (root / "bench" / "README.md").read_text().splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in lines if line.startswith("| ")]
    return rows[1:]


def named_paths(cell: str) -> list[str]:
    """Backquoted repository paths in a cell; templates (`<run>`, `$OUT`, `{...}`) left out."""
    return [p for p in re.findall(r"`([^`\s]+)`", cell)
            if "/" in p and not re.search(r"[<>${}]", p)]


def index_problems(root: Path) -> list[str]:
    """What is wrong with the index against the tree at `root`, one line each."""
    rows = index_rows(root)
    problems = [f"row {i} has {len(r)} cells, not 4" for i, r in enumerate(rows) if len(r) != 4]
    cited: set[Path] = set()
    for row in (r for r in rows if len(r) == 4):
        _, script, command, results = row
        scripts = named_paths(script) + re.findall(r"\bbench/[\w/]+\.py\b", command)
        problems += [f"no script {p}" for p in scripts if not (root / p).is_file()]
        for p in named_paths(results):
            if not (root / p).exists() or ((root / p).is_dir() and not any((root / p).iterdir())):
                problems.append(f"no results {p}")
            parts = Path(p).parts
            if len(parts) >= 4 and parts[2] == "results":
                cited.add(Path(*parts[:4]))
    for folder in sorted((root / "bench").glob("*/results/*")):
        if folder.relative_to(root) not in cited:
            problems.append(f"results behind no figure: {folder.relative_to(root)}")
    return problems


def run_names(root: Path) -> list[str]:
    """Run names in the code and the front docs, other than in a results folder's path."""
    files = [*(root / "ray_ple").rglob("*.py"), *(root / "bench").glob("*/*.py"),
             root / "README.md", *(root / "docs").glob("*.md"),
             *(root / "bench").glob("**/README.md")]
    found: list[str] = []
    for path in files:
        if "results" in path.parts or path.name == "history.md":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if RUN_NAME.search(RESULTS_PATH.sub("", line)):
                found.append(f"{path.relative_to(root)}:{n}")
    return found


def test_bench_index_names_only_what_exists_and_every_results_folder() -> None:
    assert index_rows(ROOT), "bench/README.md has no table"
    assert index_problems(ROOT) == []


def test_readme_links_the_index() -> None:
    assert "(bench/README.md)" in (ROOT / "README.md").read_text()


def test_no_run_names_outside_results() -> None:
    assert run_names(ROOT) == []
