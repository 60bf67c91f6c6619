"""ray-ple: serve PLE models with vLLM on Ray Serve, the per-layer-embedding table in host RAM.

Two sides per engine worker, one supervisor per replica (`docs/design-notes.md#topology`):

    protocol/     what both sides share: segment layout, handles, geometry, the transaction
                  (every rule, once), the fatal path; imports nothing above it
    offload/      the CPU-only side: the offload actor, the node's table copy, the gather
    worker/       the engine side: the worker's pair, the pull op, transports, vLLM plugin
    supervision/  one supervisor per replica: builds the offload actors, watches, ends
    serve/        `serve run` (builder -> server), on Ray Serve LLM
    tools/        the `ray-ple` CLI: doctor, install check, KubeRay manifests
    instrument/   fault cut points and benchmark timestamps the sides call, inert by default
    checkpoints/  a model_source -> its checkpoint; the embedded tiny models (ray-ple://...)

Beside them: `config` (the `ple:` block), `errors` (every user-facing error), `log` (one line
per event), `base` (the frozen model every boundary uses), `engine_plan` (checkpoint + `ple:`
-> engine arguments) with what it hands each side, `engine_settings` (to the worker, through
vLLM) and `table_source` (to the offload actor), `offline` (`vllm.LLM` with its offload
actors). Imports run one way: protocol <-
offload, worker <- supervision <- serve; tools load the rest lazily (tests/test_layout.py
enforces it; docs/layout.md's map lists every file).
"""
