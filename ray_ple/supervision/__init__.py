"""One supervisor per replica, outside every process it watches.

`supervisor` (builds, watches, ends the replica), `offload_group` (the replica's offload
actors), `engine_leftovers` (vLLM's /dev/shm names a killed engine leaves), `metrics`.
"""
