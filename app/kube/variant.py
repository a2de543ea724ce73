"""A cluster variant: what a RayService needs beyond the Serve config (pods, GPUs, storage).

`serve_config.yaml` stays the one source for the application; a variant file
(`k8s/variants/<name>.yaml`) adds the cluster shape and the per-deployment placement patches
that pin the shared prefill group and the decoder groups onto their own worker groups.
Loaded strictly: a misspelt key is an error naming the file and the field.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefillshare.app.errors import PrefillShareLibraryError

# Same grammar as the CRD's resource-quantity pattern, checked early with the variant's name.
_QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 1e-3, "": 1}


def quantity_bytes(q: str) -> float:
    """A Kubernetes quantity ("16Gi", "500M", "1e9") as a number."""
    s = str(q)
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            return float(s[: -len(suffix)]) * _SUFFIX[suffix]
    return float(s)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PodShape(_Strict):
    """Container requests (= limits, so pods get Guaranteed QoS and Ray sees fixed capacity)."""

    cpu: str = Field(pattern=_QUANTITY)
    memory: str = Field(pattern=_QUANTITY)
    gpus: int = Field(0, ge=0)
    shm: str | None = Field(None, pattern=_QUANTITY, description="/dev/shm size (Ray object store, KV pool)")
    object_store_gib: float | None = Field(
        None, gt=0, alias="objectStoreGiB",
        description="Ray object store size; must fit in shm (Ray's default, 30% of memory, often does not)",
    )

    @model_validator(mode="after")
    def _store_fits_shm(self) -> PodShape:
        if self.object_store_gib is not None:
            if self.shm is None:
                raise ValueError("objectStoreGiB needs shm (the object store lives in /dev/shm)")
            if self.object_store_gib * 2**30 > quantity_bytes(self.shm):
                raise ValueError(f"objectStoreGiB {self.object_store_gib} does not fit in shm {self.shm}")
        return self


class HeadSpec(PodShape):
    num_cpus: int = Field(ge=0, alias="numCpus", description="CPUs the head advertises to Ray")


class WorkerGroup(PodShape):
    name: str = Field(pattern=_DNS_LABEL, max_length=40)
    ray_resource: str = Field(alias="rayResource", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    ray_resource_amount: int = Field(1, ge=1, alias="rayResourceAmount")
    replicas: int = Field(ge=0)
    min_replicas: int = Field(ge=0, alias="minReplicas")
    max_replicas: int = Field(ge=1, alias="maxReplicas")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    host_ipc: bool = Field(
        False, alias="hostIPC",
        description="the node's IPC namespace: CUDA IPC between pods that share a node (and see each other's GPUs)")
    rdma: dict[str, int] = Field(
        default_factory=dict,
        description="RDMA device resources per pod (an RDMA device plugin's, e.g. rdma/rdma_shared_device_a: 1): "
        "KV pulls between pods over RDMA; the container then gets IPC_LOCK (NIXL registers its memory)")

    @field_validator("rdma")
    @classmethod
    def _rdma_names(cls, v: dict[str, int]) -> dict[str, int]:
        for name, n in v.items():
            if "/" not in name or n < 1:
                raise ValueError(f"rdma: {name}: {n}: want a device plugin's resource name (vendor/device) and a count >= 1")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> WorkerGroup:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"worker group {self.name}: need minReplicas <= replicas <= maxReplicas, "
                f"got {self.min_replicas} <= {self.replicas} <= {self.max_replicas}"
            )
        return self


class ModelStorage(_Strict):
    """Where the checkpoints come from: baked into the image, or a (ReadOnlyMany) PVC."""

    kind: Literal["image", "pvc"]
    mount_path: str = Field(alias="mountPath", pattern=r"^/")
    claim_name: str | None = Field(None, alias="claimName", pattern=_DNS_LABEL)

    @model_validator(mode="after")
    def _claim(self) -> ModelStorage:
        if (self.kind == "pvc") != (self.claim_name is not None):
            raise ValueError("modelStorage.claimName is required for kind 'pvc' and not allowed for 'image'")
        return self


class ServePatches(_Strict):
    """RFC 7386 merge patches on the Serve config.

    `config` patches the whole file, `application` every application; `prefill_modules` and
    `decoders` patch the items of the app config (`args.config`) whose name matches the key
    (an fnmatch pattern), `deployments` the entries of Serve's `deployments:` list the same way.
    A pattern that matches nothing is an error, so a renamed model cannot silently lose its GPU.
    """

    config: dict[str, Any] = Field(default_factory=dict)
    application: dict[str, Any] = Field(default_factory=dict)
    prefill_modules: dict[str, dict[str, Any]] = Field(default_factory=dict)
    decoders: dict[str, dict[str, Any]] = Field(default_factory=dict)
    deployments: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Variant(_Strict):
    name: str = Field(pattern=_DNS_LABEL, max_length=40, description="RayService name")
    namespace: str | None = Field(None, pattern=_DNS_LABEL)
    output: str = Field(pattern=r"^[A-Za-z0-9_.-]+\.yaml$", description="file under k8s/")
    description: str = ""
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", alias="imagePullPolicy")
    ray_version: str = Field(alias="rayVersion")
    auth_secret: str = Field(alias="authSecret", pattern=_DNS_LABEL)
    api_keys_secret: str | None = Field(
        None, alias="apiKeysSecret", pattern=_DNS_LABEL,
        description="Secret whose key `api_keys` (YAML mapping API key -> tenant) reaches every pod as "
        "PREFILLSHARE_API_KEYS; the app then requires keys (auth.required)")
    service_name: str = Field(alias="serviceName", pattern=_DNS_LABEL)
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", alias="serviceType")
    model_storage: ModelStorage = Field(alias="modelStorage")
    env: dict[str, str] = Field(default_factory=dict)
    head: HeadSpec
    worker_groups: list[WorkerGroup] = Field(alias="workerGroups", min_length=1)
    serve: ServePatches = Field(default_factory=ServePatches)

    @field_validator("worker_groups")
    @classmethod
    def _distinct(cls, groups: list[WorkerGroup]) -> list[WorkerGroup]:
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"worker group names repeat: {names}")
        res = [g.ray_resource for g in groups]
        if len(set(res)) != len(res):
            raise ValueError(f"each worker group needs its own rayResource, got {res}")
        return groups


class VariantError(PrefillShareLibraryError, ValueError):
    """A variant file that cannot be used; the message names the file and field."""


def load_variant(path: str | Path) -> Variant:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise VariantError(f"{path}: {e}") from e
    if not isinstance(raw, dict):
        raise VariantError(f"{path}: expected a mapping at the top level")
    try:
        return Variant.model_validate(raw)
    except ValidationError as e:
        lines = [f"{'.'.join(map(str, err['loc'])) or '<top>'}: {err['msg']}" for err in e.errors()]
        raise VariantError(f"{path}: " + "; ".join(lines)) from e
