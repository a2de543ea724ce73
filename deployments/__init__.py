"""The Ray Serve deployments: ingress, request path, engine replicas, request routers.

Imported as ``prefillshare.deployments`` (pyproject.toml maps this deployments/ folder to that name).
"""
if __name__ != "prefillshare.deployments":  # e.g. `import deployments` with the repository root on sys.path
    raise ImportError(f"{__file__} is imported as `prefillshare.deployments`, not `{__name__}`: a second copy of its "
                      "modules under another name would not share their state")
