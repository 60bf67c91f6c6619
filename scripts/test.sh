#!/usr/bin/env bash
# Install ray-ple from scratch and run the whole test suite (what .ci/run runs).
# Arguments go to pytest (`scripts/test.sh tests/test_pair.py -k fold`). The run fails, and
# lists them, when a selected test never finished (the process ended mid-run, even with
# status 0) or skipped without being an expected skip on a CPU machine
# (scripts/check_test_report.py); pytest's closing line stays the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export RAY_PLE_KUBERAY_CRDS=${RAY_PLE_KUBERAY_CRDS:-$(cd .. && pwd)/shared/kuberay}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
color=()
if [ -t 1 ]; then color=(--color=yes); fi
set +e
.venv/bin/python -u -m pytest -ra --durations=25 --timeout=1200 "${color[@]}" \
  -p scripts.check_test_report --test-record "$work/record.jsonl" "$@" | tee "$work/pytest.out"
status=${PIPESTATUS[0]}
set -e
.venv/bin/python scripts/check_test_report.py "$work/record.jsonl" --pytest-exit "$status" \
  --pytest-output "$work/pytest.out"
