"""The library: config, plan, engines and their hand-over, models, training, rendering.

Imported as ``prefillshare.app`` (pyproject.toml maps this app/ folder to that name).
"""
if __name__ != "prefillshare.app":  # e.g. `import app` with the repository root on sys.path
    raise ImportError(f"{__file__} is imported as `prefillshare.app`, not `{__name__}`: a second copy of its "
                      "modules under another name would not share their state")
