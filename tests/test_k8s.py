"""KubeRay manifests, offline: CRD schema (strict, as the API server), Serve schema, drift, capacity."""
from __future__ import annotations

import base64
import copy
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helm_binary import helm_binary
from ray.serve.schema import ServeDeploySchema

from prefillshare.app.kube.capacity import check_capacity
from prefillshare.app.kube.crd import CrdValidator, ManifestInvalid
from prefillshare.app.kube.render import (
    API_KEYS_ENV,
    API_KEYS_SECRET_KEY,
    SERVE_PORT,
    RayServiceRenderError,
    merge_patch,
    parse_ray_resources_param,
    render_all,
    render_rayservice,
    secret_manifest,
)
from prefillshare.app.kube.variant import VariantError, load_variant

REPO = Path(__file__).resolve().parent.parent
CRD_DIR = REPO / "tests" / "data" / "kuberay"  # KubeRay v1.7.0's CRDs, kept as data (its README: source, sums)
MANIFESTS = sorted((REPO / "k8s").glob("rayservice-*.yaml"))
VARIANTS = sorted((REPO / "k8s" / "variants").glob("*.yaml"))


@pytest.fixture(scope="module")
def crds() -> CrdValidator:
    return CrdValidator.from_dir(CRD_DIR)


def test_the_crds_are_the_ones_their_readme_names():
    """The copied CRDs are data: their bytes are what tests/data/kuberay/README.md records."""
    import hashlib

    recorded = dict(re.findall(r"\| `(ray\.io_\w+\.yaml)` \|[^|]*\| `([0-9a-f]{64})` \|",
                               (CRD_DIR / "README.md").read_text()))
    assert set(recorded) == {p.name for p in CRD_DIR.glob("*.yaml")} == {"ray.io_rayservices.yaml",
                                                                          "ray.io_rayclusters.yaml"}
    for name, digest in recorded.items():
        assert hashlib.sha256((CRD_DIR / name).read_bytes()).hexdigest() == digest, name


def _load(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1, f"{path}: expected one document"
    return docs[0]


@pytest.fixture(scope="module")
def gpu_manifest() -> dict:
    return _load(REPO / "k8s" / "rayservice-gpu.yaml")


def test_one_manifest_per_variant():
    outputs = sorted(REPO / "k8s" / load_variant(v).output for v in VARIANTS)
    assert outputs == MANIFESTS, "every variant renders one committed manifest and nothing else is there"
    assert {p.name for p in MANIFESTS} >= {"rayservice-gpu.yaml", "rayservice-cpu.yaml"}


# ---- one source of truth ---------------------------------------------------------------------

def test_manifests_match_serve_config():
    stale = [str(r.output) for r in render_all(REPO, check=True) if not r.up_to_date]
    assert not stale, f"re-run `prefillshare k8s render`: {stale} drifted from serve_config.yaml"


def test_drift_is_detected(tmp_path):
    """An edit to serve_config.yaml that the manifests do not carry makes the check fail."""
    src = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    cfg = src["applications"][0]["args"]["config"]
    cfg["limits"] = merge_patch(cfg.get("limits") or {}, {"max_agents": 7})
    edited = tmp_path / "serve_config.yaml"
    edited.write_text(yaml.safe_dump(src, sort_keys=False))
    results = render_all(REPO, edited, check=True)
    assert results and all(not r.up_to_date for r in results)
    for r in results:  # the re-rendered text carries the edit
        serve = yaml.safe_load(yaml.safe_load(r.text)["spec"]["serveConfigV2"])
        assert serve["applications"][0]["args"]["config"]["limits"]["max_agents"] == 7


def test_render_check_command_exits_zero_when_current():
    out = subprocess.run([sys.executable, "-m", "prefillshare.app.kube", "render", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("up to date") == 2 * len(MANIFESTS), "each manifest and its Helm chart copy"


# ---- Serve config embedded in each manifest ---------------------------------------------------

@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_serve_config_v2_valid_and_imports(path):
    doc = _load(path)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(serve)
    assert schema.http_options.host == "0.0.0.0", "the proxy must listen on the pod IP"
    assert schema.http_options.port == SERVE_PORT == doc["spec"]["serveService"]["spec"]["ports"][0]["targetPort"]
    for app in schema.applications:
        module, _, attr = app.import_path.partition(":")
        target = importlib.import_module(module)
        for part in (attr or "app").split("."):
            target = getattr(target, part)
        assert callable(target), f"{app.import_path} is not an application builder"
        from prefillshare.app.config import load_config

        load_config(app.args["config"])  # the typed app config accepts what the variant produced


def test_cpu_variant_models_are_in_the_repo():
    """The CPU image copies the repo to /app; every model path the manifest names must exist."""
    from prefillshare.app.config import load_config

    doc = _load(REPO / "k8s" / "rayservice-cpu.yaml")
    cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]
    assert cfg["root"] == "/app"
    app_cfg = load_config({**cfg, "root": str(REPO)})
    app_cfg.check_paths()


# ---- CRD schema, strict -----------------------------------------------------------------------

@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_valid_against_crd(crds, path):
    doc = _load(path)
    assert crds.knows(doc)
    assert crds.errors(doc) == []


def _mutations():
    head = ("spec", "rayClusterConfig", "headGroupSpec")
    w0 = ("spec", "rayClusterConfig", "workerGroupSpecs", 0)
    c0 = w0 + ("template", "spec", "containers", 0)
    return [
        # (id, path, new value or callable, substring expected in the error)
        ("wrong-type-replicas", w0 + ("replicas",), "3", "replicas: '3' is not of type 'integer'"),
        ("wrong-type-rayStartParams", head + ("rayStartParams", "num-cpus"), 6, "is not of type 'string'"),
        ("unknown-field-spec", ("spec", "serveConfig"), "x", "Additional properties are not allowed ('serveConfig'"),
        ("unknown-field-container", c0 + ("imagePullPolcy",), "Always", "'imagePullPolcy' was unexpected"),
        ("unknown-field-probe", c0 + ("readinessProbe", "httpGet", "scheme_"), "HTTP", "'scheme_' was unexpected"),
        ("bad-quantity-space", c0 + ("resources", "limits", "memory"), "64 GB", "limits.memory"),
        ("bad-quantity-unit", c0 + ("resources", "requests", "memory"), "64GB", "requests.memory"),
        ("bad-quantity-lowercase", c0 + ("resources", "limits", "cpu"), "8cores", "limits.cpu"),
        ("int32-overflow", w0 + ("maxReplicas",), 2**31, "maxReplicas"),
        ("enum", ("spec", "rayClusterConfig", "authOptions", "mode"), "password", "authOptions.mode"),
        ("bad-name", ("metadata", "name"), "PrefillShare_GPU", "metadata.name"),
        ("missing-required", w0 + ("groupName",), None, "'groupName' is a required property"),
        ("duplicate-container-port", c0 + ("ports",), lambda ports: ports + [dict(ports[0])], "duplicate entry"),
    ]


def _set(doc: dict, path: tuple, value) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    elif callable(value):
        node[path[-1]] = value(node[path[-1]])
    else:
        node[path[-1]] = value


@pytest.mark.parametrize("case", _mutations(), ids=lambda c: c[0])
def test_broken_manifest_is_rejected(crds, gpu_manifest, case):
    name, path, value, expected = case
    doc = copy.deepcopy(gpu_manifest)
    _set(doc, path, value)
    errs = crds.errors(doc)
    assert errs, f"{name}: accepted a manifest the API server would refuse"
    assert any(expected in e for e in errs), errs
    with pytest.raises(ManifestInvalid):
        crds.validate(doc, name)


def test_unknown_kind_is_refused(crds, gpu_manifest):
    doc = dict(gpu_manifest, apiVersion="ray.io/v2")
    assert "is not one of" in crds.errors(doc)[0]


# ---- cluster shape: GPUs, groups, capacity ----------------------------------------------------

@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_replica_fits_at_full_scale(path):
    problems, pools = check_capacity(_load(path))
    assert problems == []
    placed = {d for p in pools for d in p.placed}
    assert any("/Prefill-" in d for d in placed) and any("/Decode-" in d for d in placed), placed


def test_gpu_prefill_and_decoders_share_multi_gpu_pods(gpu_manifest):
    """The GPU variant puts the shared prefill replicas and the decoders in pods of several GPUs
    (one node each), so a decoder's pull stays in its pod: CUDA IPC, device to device."""
    problems, pools = check_capacity(gpu_manifest)
    assert problems == []
    by_name = {p.name: p for p in pools}
    node = by_name["gpu-node"]
    assert node.per_pod["GPU"] >= 2
    assert any("/Prefill-" in d for d in node.placed) and any("/Decode-" in d for d in node.placed)
    assert not any("/Decode-" in d or "/Prefill-" in d for d in by_name["head"].placed)
    serve = yaml.safe_load(gpu_manifest["spec"]["serveConfigV2"])
    cfg = serve["applications"][0]["args"]["config"]
    engines = cfg["prefill_modules"] + cfg["decoders"]
    # every engine's bundle asks for the one group resource: prefill and decoders land on the same pods
    assert {tuple(sorted(k for k in b if k not in ("CPU", "GPU"))) for e in engines
            for b in e["placement"]["placement_group_bundles"]} == {("gpu_node",)}
    # one pod holds a replica of the prefill and of every decoder, and the initial cluster holds
    # every engine's replicas at the autoscalers' minimum (the Ray autoscaler adds pods beyond it)
    (group,) = [g for g in gpu_manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu-node"]
    assert len(engines) <= node.per_pod["GPU"]
    need = sum(e["placement"]["autoscaling"]["min_replicas"] for e in engines)
    assert need <= node.per_pod["GPU"] * group["replicas"]
    at_max = sum(e["placement"]["autoscaling"]["max_replicas"] for e in engines)
    assert node.per_pod["GPU"] * group["replicas"] < at_max <= node.per_pod["GPU"] * group["maxReplicas"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == node.per_pod["GPU"] == node.per_pod["gpu_node"]
    assert cfg["handover"] == "vllm-nixl"


def test_gpu_variant_is_sized_for_an_8b_model_at_4k_with_8_decoders(gpu_manifest):
    """docs/scaling.md "GPU KV space and lease": the prefill engine holds the unpulled 4K leases of
    an 8B model for a lease's time, a decoder its sequences' 4K contexts."""
    from prefillshare.app.config import load_config

    serve = yaml.safe_load(gpu_manifest["spec"]["serveConfigV2"])
    cfg = load_config(serve["applications"][0]["args"]["config"])
    per_token = 2 * 32 * 8 * 128 * 2          # K and V x layers x KV heads x head_dim x bf16
    context = 4096 * per_token                 # 512 MiB
    (prefill,) = cfg.prefill_modules
    assert prefill.engine.kv_cache_memory_bytes >= 32 * context  # >= 32 contexts in flight
    assert cfg.kv_lease_duration is not None and cfg.kv_lease_duration <= 60
    # unpulled leases (decoders that fell back) it can hold for a whole lease: >= 0.5 sessions/s per replica
    assert prefill.engine.kv_cache_memory_bytes / context / cfg.kv_lease_duration >= 0.5
    for d in cfg.decoders:
        assert d.engine.kv_cache_memory_bytes >= d.engine.max_num_seqs * (4096 + 256) * per_token


def test_rdma_and_host_ipc_render_and_validate(crds, tmp_path):
    """A GPU variant with RDMA devices and host IPC: the pods ask for the device plugin's resource,
    get IPC_LOCK and the node's IPC namespace, and the manifest still passes the CRD."""
    raw = yaml.safe_load((REPO / "k8s" / "variants" / "gpu.yaml").read_text())
    raw["workerGroups"][0].update(hostIPC=True, rdma={"rdma/rdma_shared_device_a": 1})
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    doc = render_rayservice(yaml.safe_load((REPO / "serve_config.yaml").read_text()), load_variant(path))
    crds.validate(doc)
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    c = pod["containers"][0]
    assert pod["hostIPC"] is True
    assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == c["resources"]["requests"]["rdma/rdma_shared_device_a"] == 1
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert check_capacity(doc)[0] == []
    # the shipped variant asks for neither
    shipped = yaml.safe_load((REPO / "k8s" / "rayservice-gpu.yaml").read_text())
    spec = shipped["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "hostIPC" not in spec and "securityContext" not in spec["containers"][0]


def _with_serve(manifest: dict, edit) -> dict:
    doc = copy.deepcopy(manifest)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    edit(serve["applications"][0]["args"]["config"])
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    return doc


def test_capacity_catches_too_many_decoder_replicas(gpu_manifest):
    groups = {g["groupName"]: g for g in gpu_manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    gpus = groups["gpu-node"]["maxReplicas"] * groups["gpu-node"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["nvidia.com/gpu"]

    def edit(cfg):  # the autoscaler's maximum is what must fit
        cfg["decoders"][0]["placement"]["autoscaling"]["max_replicas"] = gpus + 1

    problems, _ = check_capacity(_with_serve(gpu_manifest, edit))
    assert any("does not fit in gpu-node" in p for p in problems), problems


def test_capacity_catches_unadvertised_resource_and_unpinned_gpu(gpu_manifest):
    def edit(cfg):
        cfg["decoders"][0]["placement"]["placement_group_bundles"] = [{"CPU": 4, "GPU": 1, "decoder_node": 1}]
        cfg["decoders"][1]["placement"]["placement_group_bundles"] = [{"CPU": 4, "GPU": 1}]

    problems, _ = check_capacity(_with_serve(gpu_manifest, edit))
    assert any("no node group advertises ['decoder_node']" in p for p in problems), problems
    assert any("without a group resource" in p for p in problems), problems


def test_ray_resources_param_survives_kubrays_bash_line(gpu_manifest):
    """KubeRay joins rayStartParams into a bash command (`ray start ... --resources=<value>`);
    what bash hands to ray start must be the JSON the group means."""
    import json

    for g in gpu_manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        raw = g["rayStartParams"]["resources"]
        out = subprocess.run(["bash", "-c", f"printf '%s' --resources={raw}"], capture_output=True, text=True)
        arg = out.stdout
        assert arg.startswith("--resources={"), arg
        group = next(w for w in load_variant(REPO / "k8s" / "variants" / "gpu.yaml").worker_groups
                     if w.name == g["groupName"])
        assert json.loads(arg.split("=", 1)[1]) == parse_ray_resources_param(raw) == {
            group.ray_resource: group.ray_resource_amount}


def test_probes_and_service(gpu_manifest):
    spec = gpu_manifest["spec"]
    assert spec["serveService"]["spec"]["ports"][0]["port"] == SERVE_PORT
    pods = [spec["rayClusterConfig"]["headGroupSpec"]] + spec["rayClusterConfig"]["workerGroupSpecs"]
    for g in pods:
        c = g["template"]["spec"]["containers"][0]
        assert c["livenessProbe"]["httpGet"]["path"] == "/api/local_raylet_healthz"
        assert c["readinessProbe"]["httpGet"]["port"] in (8265, 52365)
        declared = {p["containerPort"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["port"] in declared


def test_models_volume_mounted_where_root_points(gpu_manifest):
    serve = yaml.safe_load(gpu_manifest["spec"]["serveConfigV2"])
    root = serve["applications"][0]["args"]["config"]["root"]
    for g in gpu_manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        mounts = g["template"]["spec"]["containers"][0]["volumeMounts"]
        assert any(m["mountPath"] == root and m["readOnly"] for m in mounts)


# ---- auth -------------------------------------------------------------------------------------

def test_token_auth_uses_the_secret_the_cli_prints():
    out = subprocess.run([sys.executable, "-m", "prefillshare.app.kube", "secret"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    secret = yaml.safe_load(out.stdout)
    token = secret["stringData"]["auth_token"]
    assert len(token) >= 32
    again = yaml.safe_load(subprocess.run([sys.executable, "-m", "prefillshare.app.kube", "secret"], cwd=REPO,
                                          capture_output=True, text=True, timeout=60).stdout)
    assert again["stringData"]["auth_token"] != token, "tokens are random, never a shipped constant"
    for path in MANIFESTS:
        auth = _load(path)["spec"]["rayClusterConfig"]["authOptions"]
        assert auth == {"mode": "token", "secretName": secret["metadata"]["name"]}
    with pytest.raises(ValueError):
        secret_manifest("x", "short")


# ---- variant files and patches ----------------------------------------------------------------

def test_merge_patch_semantics():
    target = {"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2]}
    assert merge_patch(target, {"b": {"c": None, "e": 4}, "l": [9], "a": None}) == {"b": {"d": 3, "e": 4}, "l": [9]}
    assert target == {"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2]}, "the input is not modified"


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda v: v.update(imagePullPolcy="Always"), "imagePullPolcy"),
        (lambda v: v["workerGroups"][0].update(memory="64 GB"), "workerGroups.0.memory"),
        (lambda v: v["workerGroups"][0].update(replicas=9, maxReplicas=4), "replicas <= maxReplicas"),
        (lambda v: v["workerGroups"].append(dict(v["workerGroups"][0], name="other")), "own rayResource"),
        (lambda v: v["modelStorage"].pop("claimName"), "claimName"),
        (lambda v: v["workerGroups"][0].update(shm="4Gi", objectStoreGiB=8), "does not fit in shm 4Gi"),
        (lambda v: v["workerGroups"][0].update(rdma={"ib": 1}), "workerGroups.0.rdma"),
    ],
    ids=["unknown-key", "bad-quantity", "replica-bounds", "shared-resource", "pvc-without-claim", "store-over-shm",
         "rdma-name"],
)
def test_bad_variant_names_the_field(tmp_path, edit, field):
    raw = yaml.safe_load((REPO / "k8s" / "variants" / "gpu.yaml").read_text())
    edit(raw)
    bad = tmp_path / "gpu.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(VariantError, match=field.replace(".", r"\.").replace("<", ".")):
        load_variant(bad)


def test_patch_that_matches_nothing_is_an_error():
    serve = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    variant = load_variant(REPO / "k8s" / "variants" / "gpu.yaml")
    patched = variant.model_copy(
        update={"serve": variant.serve.model_copy(update={"decoders": {"no-such-decoder": {"placement": {}}}})}
    )
    with pytest.raises(RayServiceRenderError, match="no-such-decoder"):
        render_rayservice(serve, patched)


# ---- Helm chart (k8s/chart): installs exactly the rendered manifests ----------------------------

CHART = REPO / "k8s" / "chart"


def _helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def _template(*sets: str) -> dict[str, dict]:
    out = _helm("template", "demo", str(CHART), "-n", "team-a", *sum((["--set", s] for s in sets), []))
    assert out.returncode == 0, out.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(out.stdout) if d}


def test_helm_lint():
    out = _helm("lint", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("variant", [v.stem for v in VARIANTS])
def test_helm_chart_installs_the_rendered_manifest(variant):
    docs = _template(f"variant={variant}")
    got = docs["RayService"]
    want = _load(REPO / "k8s" / load_variant(REPO / "k8s" / "variants" / f"{variant}.yaml").output)
    assert got["metadata"]["namespace"] == "team-a"
    assert got["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    assert got["spec"] == want["spec"], "the chart must not change what the renderer produced"
    token = base64.b64decode(docs["Secret"]["data"]["auth_token"]).decode()
    assert len(token) == 48 and docs["Secret"]["metadata"]["name"] == want["spec"]["rayClusterConfig"]["authOptions"]["secretName"]
    again = _template(f"variant={variant}")["Secret"]["data"]["auth_token"]
    assert again != docs["Secret"]["data"]["auth_token"], "a fresh random token per install"


def test_helm_overrides_stay_valid(crds):
    docs = _template("variant=gpu", "image=registry.local/ps:9", "imagePullPolicy=Always",
                     "serviceType=LoadBalancer", "nameOverride=ps-prod", "authSecret.create=false")
    assert set(docs) == {"RayService", "NetworkPolicy", "ConfigMap"}  # ConfigMap: the Grafana dashboard
    doc = docs["RayService"]
    rc = doc["spec"]["rayClusterConfig"]
    containers = [c for g in [rc["headGroupSpec"], *rc["workerGroupSpecs"]] for c in g["template"]["spec"]["containers"]]
    assert {(c["image"], c["imagePullPolicy"]) for c in containers} == {("registry.local/ps:9", "Always")}
    assert doc["spec"]["serveService"]["spec"]["type"] == "LoadBalancer" and doc["metadata"]["name"] == "ps-prod"
    assert crds.errors(doc) == []
    docs = _template("variant=gpu", "nameOverride=PS_Prod")
    assert any("metadata.name" in e for e in crds.errors(docs["RayService"])), "bad values are caught by the schema"


def test_helm_unknown_variant_fails_with_a_reason():
    out = _helm("template", "demo", str(CHART), "--set", "variant=tpu")
    assert out.returncode != 0 and "files/rayservice-tpu.yaml" in out.stderr


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_require_api_keys_from_a_secret_in_every_pod(path):
    """Issue 7: keys at the ingress are on in the KubeRay manifests (off by default locally)."""
    from prefillshare.app.config import load_config

    doc = _load(path)
    for app in yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]:
        auth = load_config(app["args"]["config"]).auth
        assert auth.required and auth.keys_env == API_KEYS_ENV
    cluster = doc["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:  # the Router replica may land on any pod
        for c in pod["spec"]["containers"]:
            ref = next(e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == API_KEYS_ENV)
            assert ref == {"name": "prefillshare-api-keys", "key": API_KEYS_SECRET_KEY}


def test_api_keys_command_prints_a_secret_the_app_reads(capsys):
    from prefillshare.app.auth import load_keyring
    from prefillshare.app.cli import main as cli

    assert cli(["k8s", "api-keys", "team-a", "team-b", "--namespace", "ml"]) == 0
    secret = yaml.safe_load(capsys.readouterr().out)
    assert secret["kind"] == "Secret" and secret["metadata"] == {"name": "prefillshare-api-keys", "namespace": "ml"}
    ring = load_keyring(None, API_KEYS_ENV, required=True,
                        environ={API_KEYS_ENV: secret["stringData"][API_KEYS_SECRET_KEY]})
    assert ring.tenants == {"team-a", "team-b"}
    key = next(k for k, t in yaml.safe_load(secret["stringData"][API_KEYS_SECRET_KEY]).items() if t == "team-b")
    assert ring.lookup(f"Bearer {key}").name == "team-b" and ring.lookup("Bearer sk-wrong") is None
