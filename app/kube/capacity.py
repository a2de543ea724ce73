"""Does a RayService's cluster have room for its own Serve config at full scale?

The CRD schema cannot see that a deployment asks for `prefill_node` while no worker group
advertises it, or that eight decoders at their autoscaling maximum need more GPUs than the
decode group's `maxReplicas` pods hold; Ray would leave such replicas pending forever. This
module packs every deployment's replicas at their maximum (first fit, largest first) into
the pods of each group at `maxReplicas` and reports what does not fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from prefillshare.app.kube.render import parse_ray_resources_param

_CPU, _GPU = "CPU", "GPU"


def cpu_quantity(q: Any) -> float:
    """A Kubernetes CPU quantity ("8", "500m", 2) as a number of cores."""
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


@dataclass
class Demand:
    deployment: str
    per_replica: dict[str, float]
    max_replicas: int

    @property
    def pinned_to(self) -> list[str]:
        return sorted(k for k in self.per_replica if k not in (_CPU, _GPU, "memory") and not k.startswith("node:"))


@dataclass
class Pool:
    """One Ray node group: `pods` identical pods of `per_pod` logical resources."""

    name: str
    per_pod: dict[str, float]
    pods: int
    placed: dict[str, int] = field(default_factory=dict)


def _bundle_sum(bundles: list[dict]) -> dict[str, float]:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + float(v)
    return need


def _config_demands(app_name: str, app_cfg: dict) -> list[Demand]:
    """Demands of the deployments the app builds from its typed config (prefillshare.app.config)."""
    from prefillshare.app.config import load_config

    cfg = load_config(app_cfg)
    out = []
    # Names as deployments/application.py gives the deployments (docs/DESIGN.md).
    for kind, items in (("Prefill", cfg.prefill_modules), ("Decode", cfg.decoders)):
        for item in items:
            pl = item.placement
            need = (
                _bundle_sum(pl.placement_group_bundles)
                if pl.placement_group_bundles
                else {_CPU: pl.num_cpus, _GPU: pl.num_gpus}
            )
            out.append(Demand(f"{app_name}/{kind}-{item.name}", {k: v for k, v in need.items() if v}, pl.max_replicas))
    for name in ("router", "orchestrator", "metrics"):
        small = getattr(cfg, name, None)
        if small is not None:
            out.append(Demand(f"{app_name}/{name.capitalize()}", {_CPU: small.num_cpus} if small.num_cpus else {},
                              small.max_replicas))
    return out


def deployment_demands(serve_config: dict) -> list[Demand]:
    """Per-replica logical resources and maximum replicas of every deployment the config runs."""
    out = []
    for app in serve_config.get("applications") or []:
        app_name = app.get("name", "default")
        app_cfg = (app.get("args") or {}).get("config")
        if isinstance(app_cfg, dict):
            out += _config_demands(app_name, app_cfg)
            continue
        for dep in app.get("deployments") or []:
            name = f"{app_name}/{dep['name']}"
            opts = dep.get("ray_actor_options") or {}
            bundles = dep.get("placement_group_bundles")
            if bundles:
                need = _bundle_sum(bundles)
            else:
                need = {_CPU: float(opts.get("num_cpus", 1)), _GPU: float(opts.get("num_gpus", 0))}
                for k, v in (opts.get("resources") or {}).items():
                    need[k] = float(v)
            auto = dep.get("autoscaling_config")
            n = auto.get("max_replicas", 1) if auto else dep.get("num_replicas", 1)
            if not isinstance(n, int):
                raise ValueError(f"{name}: set autoscaling_config.max_replicas or an integer num_replicas (got {n!r})")
            out.append(Demand(name, {k: v for k, v in need.items() if v}, n))
    return out


def cluster_pools(rayservice: dict) -> list[Pool]:
    rc = rayservice["spec"]["rayClusterConfig"]

    def pod_resources(group: dict) -> dict[str, float]:
        params = group.get("rayStartParams") or {}
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        res = {
            _CPU: float(params["num-cpus"]) if "num-cpus" in params else cpu_quantity(limits.get("cpu", 0)),
            _GPU: float(params["num-gpus"]) if "num-gpus" in params else float(limits.get("nvidia.com/gpu", 0)),
        }
        if "resources" in params:
            res.update({k: float(v) for k, v in parse_ray_resources_param(params["resources"]).items()})
        return res

    pools = [Pool("head", pod_resources(rc["headGroupSpec"]), 1)]
    for g in rc.get("workerGroupSpecs") or []:
        pools.append(Pool(g["groupName"], pod_resources(g), int(g["maxReplicas"])))
    return pools


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0) + 1e-9 >= v for k, v in need.items())


def check_capacity(rayservice: dict) -> tuple[list[str], list[Pool]]:
    """Problems (empty when everything fits) and where each deployment's replicas went."""
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    demands = deployment_demands(serve)
    pools = cluster_pools(rayservice)
    problems: list[str] = []
    # Free capacity per pod, per pool.
    free = {p.name: [dict(p.per_pod) for _ in range(p.pods)] for p in pools}

    def place(d: Demand, candidates: list[Pool]) -> None:
        for _ in range(d.max_replicas):
            for pool in candidates:
                slot = next((f for f in free[pool.name] if _fits(f, d.per_replica)), None)
                if slot is not None:
                    for k, v in d.per_replica.items():
                        slot[k] -= v
                    pool.placed[d.deployment] = pool.placed.get(d.deployment, 0) + 1
                    break
            else:
                where = ", ".join(p.name for p in candidates) or "no group"
                problems.append(
                    f"{d.deployment}: a replica needing {d.per_replica} does not fit in {where} "
                    f"with {d.max_replicas} replicas at the maximum"
                )
                return

    by_size = sorted(demands, key=lambda d: (-d.per_replica.get(_GPU, 0), -d.per_replica.get(_CPU, 0), d.deployment))
    for d in by_size:  # pinned deployments first: they have only one place to go
        if not d.pinned_to:
            continue
        homes = [p for p in pools if all(p.per_pod.get(r, 0) > 0 for r in d.pinned_to)]
        if not homes:
            problems.append(f"{d.deployment}: no node group advertises {d.pinned_to}")
            continue
        place(d, homes)
    for d in by_size:
        if d.pinned_to:
            continue
        if d.per_replica.get(_GPU):
            problems.append(f"{d.deployment}: asks for GPUs without a group resource; pin it to its GPU group")
            continue
        place(d, pools)
    return problems, pools
