#!/usr/bin/env bash
# Run the CUDA transport's proof on a GPU machine: environment, memlock probes, the GPU test
# module, and the benchmarks (each run as a module from the repository root). Everything goes to $OUT (default: bench/cuda/results/latest).
#
#   OUT=/some/dir bash scripts/gpu_device_run.sh [all|env|memlock|tests|bench|bench-nt|two-ranks|model|gather]
#   OUT=/some/dir bash scripts/gpu_device_run.sh bundle|vllm|bench-vllm|serve
#
# The machine needs python3 with torch (CUDA), cuda-python and numpy; pydantic and its pure
# dependencies may be given as wheels in .whl/ (installed into a private --target, no index).
# vLLM (CUDA), Ray and what they import come as the parts `scripts/gpu_bundle.py build` makes
# (.devcarry/bundle/): stage `bundle` checks the parts each call carried and unpacks them once
# all are there (into $RAY_PLE_GPU_SITE, kept while the machine is warm); the stages after it
# (`vllm`: tests/gpu/test_vllm_gpu.py, `bench-vllm`: bench/cuda/bench_vllm.py, `serve`:
# `serve run` of a GPU config) run with it on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/cuda/results/latest}
mkdir -p "$OUT"
WHAT=${1:-all}
export PYTHONUNBUFFERED=1
SITE=${RAY_PLE_GPU_SITE:-/tmp/ray-ple-gpu}
if [[ $WHAT == bundle ]]; then
  echo "=== bundle ($(date -u +%FT%TZ))"
  python3 scripts/gpu_bundle.py assemble --parts .devcarry/bundle --dest "$SITE"
  rc=$?
  if [[ $rc == 3 ]]; then exit 0; fi  # more parts come with the next call
  if [[ $rc != 0 ]]; then exit $rc; fi
  # engines start several at once: compile the bytecode once, not in each
  python3 -m compileall -q -j 0 "$SITE/site" >/dev/null 2>&1
fi
if [[ -d $SITE/site ]]; then
  export PYTHONPATH=$SITE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  # vLLM's sampler imports FlashInfer unless told not to; it is not carried
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi
if [[ $WHAT == bundle ]]; then
  python3 - <<'PY' 2>&1 | tee "$OUT/bundle.txt"
import importlib.metadata as md, sys, torch, vllm, ray, ray.serve.llm, pydantic, ray_ple
import ray_ple.offline, ray_ple.serve, ray_ple.worker.vllm_plugin.workers_gpu  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.platforms import current_platform
plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]
print("python", sys.version.split()[0], "torch", torch.__version__, "vllm", vllm.__version__,
      "ray", ray.__version__, "pydantic", pydantic.__version__, "platform",
      type(current_platform).__name__, torch.cuda.get_device_name(0), "plugins", plugins)
assert current_platform.is_cuda() and "ray_ple" in plugins
PY
  exit "${PIPESTATUS[0]}"
fi
if ! python3 -c 'import pydantic' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ray-ple-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/ray-ple-site${PYTHONPATH:+:$PYTHONPATH}
fi
stage() { echo; echo "=== $1 ($(date -u +%FT%TZ))"; }

if [[ $WHAT == all || $WHAT == env ]]; then
  stage env
  {
    date -u +%FT%TZ; uname -r; nproc; free -g | head -2; df -h /dev/shm | tail -1
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    python3 -c 'import sys, torch, numpy, pydantic; from importlib.metadata import version as v
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "cuda-bindings", v("cuda-bindings"), "numpy", numpy.__version__, "pydantic", pydantic.__version__)'
    echo "ulimit -l: $(ulimit -l)"; grep CapEff /proc/self/status
  } 2>&1 | tee "$OUT/env.txt"
fi

if [[ $WHAT == all || $WHAT == memlock ]]; then
  stage "memlock probes"
  SLOTS=$(python3 -c 'from ray_ple.protocol.layout import PairLayout
print(PairLayout.compute(8192, (17920,)).size)')
  TABLE=$((262144 * 17920 + 4096))
  P="timeout 120 python3 -m bench.cuda.memlock_probe"
  : > "$OUT/memlock.jsonl"
  for B in "$SLOTS" "$TABLE"; do
    $P --bytes "$B" --label "root, default limits" | tee -a "$OUT/memlock.jsonl"
    (ulimit -l 64 && $P --bytes "$B" --label "root, ulimit -l 64") | tee -a "$OUT/memlock.jsonl"
    $P --bytes "$B" --memlock-kib 64 --drop-ipc-lock \
      --label "root without CAP_IPC_LOCK, memlock 64 KiB" | tee -a "$OUT/memlock.jsonl"
    $P --bytes "$B" --memlock-kib 64 --uid 65534 \
      --label "uid 65534, memlock 64 KiB" | tee -a "$OUT/memlock.jsonl"
  done
fi

if [[ $WHAT == all || $WHAT == tests ]]; then
  stage "GPU tests"
  timeout 420 python3 -m pytest tests/gpu -v -rs -p no:cacheprovider --durations=0 2>&1 \
    | tee "$OUT/pytest.txt"
fi

if [[ $WHAT == all || $WHAT == bench ]]; then
  stage benchmark
  timeout 400 python3 -m bench.cuda.bench_pull --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | grep -v '^{"ray_ple"' | tee "$OUT/bench.txt"
  rm -rf /dev/shm/ray-ple-bench
fi

if [[ $WHAT == all || $WHAT == bench-nt ]]; then
  # the same, the offload process copying rows with non-temporal stores (glibc memmove of
  # >= 16,449 B; a row is 17,920 B), so the GPU reads the fresh slot from DRAM, not from the
  # writer's cache
  stage "benchmark, offload with GLIBC_TUNABLES non-temporal rows"
  NT=glibc.cpu.x86_non_temporal_threshold=16449
  GLIBC_TUNABLES=$NT /lib64/ld-linux-x86-64.so.2 --list-tunables 2>&1 | grep non_temporal
  timeout 400 python3 -m bench.cuda.bench_pull --out "$OUT/bench_nt.json" \
    --offload-env GLIBC_TUNABLES=$NT ${BENCH_ARGS:-} 2>&1 | grep -v '^{"ray_ple"' \
    | tee "$OUT/bench_nt.txt"
  rm -rf /dev/shm/ray-ple-bench
fi
if [[ $WHAT == all || $WHAT == two-ranks ]]; then
  # issue 6, partial: two rank processes on the one GPU, each with its own offload process,
  # both offload processes sharing one host table; alone vs both at once, then rank 1's
  # offload process SIGKILLed mid-run (bench/cuda/README.md, "Two ranks on one H200")
  stage "two ranks on one GPU"
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv | tee "$OUT/two_ranks_env.txt"
  timeout 380 python3 -m bench.cuda.bench_two_ranks --out "$OUT" --budget-s 240 \
    ${TWO_RANKS_ARGS:-} 2>&1 | tee "$OUT/two_ranks_log.txt" | grep -v '^{"ray_ple"'
  rm -rf /dev/shm/ray-ple-two-ranks
fi
if [[ $WHAT == all || $WHAT == model ]]; then
  # issue 12: the late pull on an E4B-shaped forward and on bench_pull's synthetic consumer
  # (bench/cuda/README.md, "The late pull"); JSON lines in $OUT/model.jsonl
  stage "late pull, model-shaped consumer"
  timeout "${MODEL_TIMEOUT:-360}" python3 -m bench.cuda.bench_model --out "$OUT" \
    ${MODEL_ARGS:-} 2>&1 | tee "$OUT/model_log.txt" | grep -v '^{"ray_ple"' \
    | tee "$OUT/model.txt"
  rm -rf /dev/shm/ray-ple-bench-model
fi
if [[ $WHAT == all || $WHAT == gather ]]; then
  # the offload side's gather alone on this host's CPU (no GPU): parts by unit take vs fancy
  # indexing, 1 and 8 threads, the node table as held (memfd) and anonymous huge pages
  stage "gather on the host CPU"
  timeout "${GATHER_TIMEOUT:-240}" python3 -m bench.cpu.bench_gather --out "$OUT" \
    ${GATHER_ARGS:---rows 262144 --tokens 1 64 256 1024 8192 --threads 1 8 --reps 40 --tables memfd anon_huge} \
    2>&1 | tee "$OUT/gather.txt"
fi
if [[ $WHAT == vllm ]]; then
  # issue 38: vLLM's own GPU runner, offload vs plain (tests/gpu/test_vllm_gpu.py)
  stage "vLLM on the GPU, offload vs plain"
  # about 14 engines start at once: one inductor compile thread each, and their runs given
  # the stage's limit less a minute (the cluster, the teardown's checks); SIGINT at the
  # limit: pytest still prints every failure and its summary
  VLLM_TIMEOUT=${VLLM_TIMEOUT:-560}
  TORCHINDUCTOR_COMPILE_THREADS=1 RAY_PLE_GPU_JOBS_S=$((VLLM_TIMEOUT - 60)) \
    timeout -s INT -k 30 "$VLLM_TIMEOUT" python3 -m pytest tests/gpu/test_vllm_gpu.py -v -rs \
    -p no:cacheprovider --durations=0 ${VLLM_ARGS:-} 2>&1 | tee "$OUT/vllm_pytest.txt"
fi
if [[ $WHAT == bench-vllm ]]; then
  # issue 38: KV cache, concurrency, tokens/s on a released geometry (bench/cuda/bench_vllm.py)
  stage "vLLM on a released geometry, offload vs plain"
  timeout "${BENCH_VLLM_TIMEOUT:-560}" python3 -m bench.cuda.bench_vllm --out "$OUT" \
    ${BENCH_VLLM_ARGS:-} 2>&1 | tee "$OUT/bench_vllm.txt"
fi
if [[ $WHAT == serve ]]; then
  # Ray Serve on the GPU: `serve run` of the E4B GPU config on E4B's geometry, its offload
  # actor SIGKILLed, the replica replaced (tests/gpu/test_serve_gpu.py); `serve run`'s own
  # output in $OUT/serve_run.log
  stage "Ray Serve on the GPU, offload actor killed"
  RAY_PLE_GPU_SERVE_LOG="$OUT/serve_run.log" timeout -s INT -k 30 "${SERVE_TIMEOUT:-560}" \
    python3 -m pytest tests/gpu/test_serve_gpu.py -v -rs -p no:cacheprovider --durations=0 \
    2>&1 | tee "$OUT/serve_pytest.txt"
fi
stage done
