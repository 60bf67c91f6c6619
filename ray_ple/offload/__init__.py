"""The CPU-only side: one offload actor per engine worker, never a CUDA context.

`actor` (serves one worker's transactions), `table_store` (the node's one read-only table
copy: who loads it, who shares it, who takes the broker over), `table_file` (the checkpoint's
tensor and its rows), `table_broker` (hands the table's fd to holders of this user),
`table_segment` (the sealed memfd, on the hugetlb pool where it fits), `gather` (rows of a
step into the slot), `cuda_guard` (keeps CUDA out, proves it).
"""
