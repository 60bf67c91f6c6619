"""KubeRay manifests for ray-ple, generated from `serve_configs/` so the two cannot drift.

- `spec`: the inputs no serve config holds (`k8s/spec/clusters.yaml`: image, head, estimates).
- `sizing`: the resource arithmetic: what each worker pod must hold for the app's replicas,
  their offload actors and the node's PLE table.
- `render`: one RayService per entry; `ray-ple render-k8s` writes them, `--check` compares.
"""
