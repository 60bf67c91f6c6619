"""The `ray-ple` command line and what it runs; imports the rest of ray_ple lazily.

`cli`, `doctor` (preflight), `install_check` (the torch companions), `quantity` (k8s sizes),
`k8s/` (RayService manifests from serve_configs).
"""
