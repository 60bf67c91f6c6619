"""The CPU-only side: one offload actor per engine worker, never a CUDA context.

`actor` (serves one worker's transactions), `table_store` (the node's one read-only table
copy), `gather` (rows of a step into the slot), `cuda_guard` (keeps CUDA out, proves it).
"""
