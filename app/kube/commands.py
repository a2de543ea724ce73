"""`prefillshare k8s ...` (also `python -m prefillshare.app.kube ...`): render, check and size the manifests."""
from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import yaml

from prefillshare.app.kube.capacity import check_capacity
from prefillshare.app.kube.render import PROJECT_ROOT, api_keys_secret_manifest, render_all, secret_manifest, to_yaml

DEFAULT_CRDS = PROJECT_ROOT / "tests" / "data" / "kuberay"  # KubeRay v1.7.0's CRDs, kept as data (README there)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="k8s_cmd", required=True)
    r = sub.add_parser("render", help="regenerate k8s/rayservice-*.yaml from serve_config.yaml + k8s/variants/")
    r.add_argument("--repo", default=str(PROJECT_ROOT))
    r.add_argument("--serve-config", default=None, help="default: <repo>/serve_config.yaml")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if a manifest is stale")
    v = sub.add_parser("validate", help="check manifests against the KubeRay CRDs and the cluster's capacity")
    v.add_argument("files", nargs="*", help="default: k8s/rayservice-*.yaml")
    v.add_argument("--crds", default=str(DEFAULT_CRDS), help="folder with KubeRay's CRD yaml files")
    s = sub.add_parser("secret", help="print a Secret holding a fresh random Ray auth token")
    s.add_argument("--name", default="prefillshare-ray-token")
    s.add_argument("--namespace", default=None)
    k = sub.add_parser("api-keys", help="print a Secret of fresh random API keys, one per tenant (apiKeysSecret)")
    k.add_argument("tenants", nargs="+", help="tenant names, e.g. team-a team-b")
    k.add_argument("--name", default="prefillshare-api-keys")
    k.add_argument("--namespace", default=None)


def run(args: argparse.Namespace) -> int:
    if args.k8s_cmd == "render":
        results = render_all(args.repo, args.serve_config, check=args.check)
        stale = [r for r in results if not r.up_to_date]
        for r in results:
            state = "up to date" if r.up_to_date else ("STALE" if args.check else "written")
            print(f"{r.output}: {state} (from {r.variant_file.name})")
        return 1 if args.check and stale else 0
    if args.k8s_cmd == "validate":
        files = [Path(f) for f in args.files] or sorted((PROJECT_ROOT / "k8s").glob("rayservice-*.yaml"))
        from prefillshare.app.kube.crd import CrdValidator  # jsonschema: the `k8s` extra

        validator = CrdValidator.from_dir(args.crds)
        bad = 0
        for f in files:
            for doc in yaml.safe_load_all(f.read_text()):
                if not doc:
                    continue
                errs = validator.errors(doc)
                if doc.get("kind") == "RayService" and not errs:
                    problems, pools = check_capacity(doc)
                    errs += [f"capacity: {p}" for p in problems]
                    for pool in pools:
                        print(f"{f.name}: group {pool.name} x{pool.pods} {pool.per_pod}: {pool.placed}")
                for e in errs:
                    print(f"{f}: {e}", file=sys.stderr)
                bad += bool(errs)
                print(f"{f}: {doc.get('kind')} {doc['metadata'].get('name')}: {'INVALID' if errs else 'ok'}")
        return 1 if bad else 0
    if args.k8s_cmd == "secret":
        print(to_yaml(secret_manifest(args.name, secrets.token_hex(32), args.namespace)), end="")
        return 0
    if args.k8s_cmd == "api-keys":
        keys = {f"sk-{secrets.token_hex(24)}": t for t in args.tenants}
        print(to_yaml(api_keys_secret_manifest(args.name, keys, args.namespace)), end="")
        return 0
    raise AssertionError(args.k8s_cmd)


def configure(parser: argparse.ArgumentParser) -> None:
    """Hook for app/cli.py's COMMANDS table."""
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefillshare k8s", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
