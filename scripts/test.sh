#!/usr/bin/env bash
# Install ray-ple from scratch and run the whole test suite (what .ci/run runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export RAY_PLE_KUBERAY_CRDS=${RAY_PLE_KUBERAY_CRDS:-$(cd .. && pwd)/shared/kuberay}
exec .venv/bin/python -m pytest -ra --durations=25 --timeout=1200 "$@"
