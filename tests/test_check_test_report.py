"""The test command's record check (scripts/check_test_report.py) on real pytest runs: a run
of a throwaway test directory in a subprocess, with the plugin writing the record, then the
check as scripts/test.sh calls it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts import check_test_report

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(project: Path, *args: str) -> tuple[int, Path, Path]:
    """pytest on `project` with the recording plugin: (exit status, record, stdout file)."""
    record, output = project / "record.jsonl", project / "pytest.out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with output.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                               "no:cacheprovider", "-p", "scripts.check_test_report",
                               "--test-record", str(record), *args], cwd=project, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False)
    return done.returncode, record, output


def write(project: Path, files: dict[str, str]) -> Path:
    (project / "pytest.ini").write_text("[pytest]\n")
    for name, body in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(body))
    return project


def check(status: int, record: Path, output: Path,
          capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = check_test_report.main([str(record), "--pytest-exit", str(status),
                                   "--pytest-output", str(output)])
    return code, capsys.readouterr().out.splitlines()


DIES = {"test_exit.py": """
    import os

    def test_before():
        pass

    def test_dies():
        os._exit(0)  # what a stray os._exit timer does to the session

    def test_after():
        pass
    """}


def test_a_run_that_ends_itself_with_status_0_fails_and_names_the_lost_tests(tmp_path, capsys):
    status, record, output = run_pytest(write(tmp_path, DIES))
    assert status == 0, "the process ended itself with status 0: pytest's status says nothing"
    code, out = check(status, record, output, capsys)
    assert code == 1
    assert "  test_exit.py::test_dies (started, never finished)" in out
    assert "  test_exit.py::test_after (never started)" in out
    assert not any("test_before" in row for row in out), "a finished test is not lost"
    assert out[-2].startswith("test record check: FAIL (2 lost; no session end)")
    assert "no closing line" in out[-1]


def test_a_deselected_test_is_not_lost_and_a_clean_run_ends_with_pytests_line(tmp_path,
                                                                               capsys):
    status, record, output = run_pytest(write(tmp_path, DIES), "-k", "before")
    assert status == 0
    code, out = check(status, record, output, capsys)
    assert code == 0, out
    assert out[0].startswith("test record: 1 selected, 1 finished (1 passed)")
    assert out[-2] == "test record check: OK"
    assert "1 passed, 2 deselected in" in out[-1], "pytest's closing line stays last"


def test_an_unexpected_skip_fails_and_is_named_and_the_gpu_skips_are_listed(tmp_path, capsys):
    status, record, output = run_pytest(write(tmp_path, {
        "tests/gpu/test_cuda.py": """
            import pytest

            @pytest.mark.skipif(True, reason="needs a CUDA GPU (none here)")
            def test_pull_on_cuda():
                pass

            def test_cuda_fixture_broke():
                pytest.skip("the rig could not start")
            """,
        "tests/test_cpu.py": """
            import pytest

            def test_runs():
                pass

            def test_tool_missing():
                pytest.skip("kubectl not found")
            """,
        "tests/test_module_gone.py": """
            import pytest

            pytest.skip("whole module skipped", allow_module_level=True)

            def test_never_collected():
                pass
            """}))
    assert status == 0, "skips are green to pytest"
    code, out = check(status, record, output, capsys)
    assert code == 1
    allowed = out.index("expected skips on a CPU machine, allowed (1):")
    assert out[allowed + 1].startswith("  tests/gpu/test_cuda.py::test_pull_on_cuda  [GPU tests")
    unexpected = out.index("UNEXPECTED SKIPS (not in CPU_MACHINE_SKIPS) (3):")
    assert set(out[unexpected + 1:unexpected + 4]) == {
        "  tests/test_module_gone.py: whole module skipped",
        "  tests/gpu/test_cuda.py::test_cuda_fixture_broke: the rig could not start",
        "  tests/test_cpu.py::test_tool_missing: kubectl not found"}
    assert out[-2] == "test record check: FAIL (3 unexpected skips)"


def test_a_failing_test_keeps_pytests_status(tmp_path, capsys):
    status, record, output = run_pytest(write(tmp_path, {"test_red.py": """
        def test_red():
            assert False
        """}))
    assert status == 1
    code, out = check(status, record, output, capsys)
    assert code == 1
    assert out[-2] == "test record check: FAIL (pytest exit status 1)"
    assert "1 failed in" in out[-1]


def test_a_missing_record_fails(tmp_path, capsys):
    code, out = check(0, tmp_path / "none.jsonl", write(tmp_path, {"x.out": ""}) / "x.out",
                      capsys)
    assert code == 1
    assert "no record at" in out[-2] and "FAIL" in out[-2]
