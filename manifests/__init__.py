"""The manifests kiln ships: this directory, one YAML per model, installed as the package
kiln_manifests (pyproject.toml maps it) so a worker or a client reads them from any directory
through importlib.resources (api_client.manifest.shipped_manifests)."""
