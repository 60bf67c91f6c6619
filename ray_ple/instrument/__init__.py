"""Test and benchmark instruments, inert unless their environment variable is set.

`faults` (named cut points, one hook each, for the cluster fault suite), `timing`
(hand-off timestamps for benchmarks).
"""
