"""KubeRay manifests: render from serve_config.yaml, validate offline against the CRDs, size."""
