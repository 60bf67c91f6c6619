"""The engine side, inside each vLLM worker process.

`pair` (this process's pair and the registry the op resolves by slot name), `ops` (the pull
op), `transport/` (the consumer: `cpu`, `cuda`), `vllm_plugin/` (model classes and runner).
"""
