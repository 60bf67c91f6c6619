"""Shared by both sides of a pair; imports nothing of ray_ple but `base`, `config`, `errors`, `log`.

`layout` (the segment's bytes), `shm` (nameless segments), `handles` (what crosses at setup),
`geometry` (a checkpoint's table), `transaction` (every rule of a step), `fatal` (sides,
reasons, the one way down), `doorbell` (a wake-up hint), `peers` (same user only),
`support` (what is served, each refusal once), `posting` (who posts a step).
"""
