"""Kubernetes side of "no KV without a key": every pod gets the KV secret from the cluster's
Secret, and the chart's NetworkPolicy admits the KV ports only from the app's own pods."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helm_binary import helm_binary

from prefillshare.app.kube.crd import CrdValidator
from prefillshare.app.kube.render import KV_SECRET_ENV, KV_SECRET_KEY

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "k8s" / "chart"
CRD_DIR = REPO / "tests" / "data" / "kuberay"  # KubeRay v1.7.0's CRDs (tests/data/kuberay/README.md)
MANIFESTS = sorted((REPO / "k8s").glob("rayservice-*.yaml"))
VARIANTS = [p.stem.removeprefix("rayservice-") for p in MANIFESTS]


def _pods(doc: dict) -> list[dict]:
    rc = doc["spec"]["rayClusterConfig"]
    return [g["template"] for g in [rc["headGroupSpec"], *rc["workerGroupSpecs"]]]


def _template(*sets: str) -> list[dict]:
    out = subprocess.run([helm_binary(), "template", "demo", str(CHART), "-n", "team-a",
                          *sum((["--set", s] for s in sets), [])], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _open_tcp(policy: dict, port: int) -> bool:
    """Whether a pod that is not the app's may reach ``port`` (a rule without ``from``)."""
    for rule in policy["spec"]["ingress"]:
        if "from" in rule:
            continue
        for p in rule.get("ports", []):
            if p["protocol"] == "TCP" and p["port"] <= port <= p.get("endPort", p["port"]):
                return True
    return False


@pytest.fixture(scope="module")
def crds() -> CrdValidator:
    return CrdValidator.from_dir(CRD_DIR)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_pod_reads_the_kv_secret_from_the_clusters_secret_and_the_manifest_validates(path, crds):
    doc = yaml.safe_load(path.read_text())
    secret = doc["spec"]["rayClusterConfig"]["authOptions"]["secretName"]
    for pod in _pods(doc):
        for c in pod["spec"]["containers"]:
            (env,) = [e for e in c["env"] if e["name"] == KV_SECRET_ENV]
            assert env["valueFrom"]["secretKeyRef"] == {"name": secret, "key": KV_SECRET_KEY}
    assert crds.errors(doc) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_chart_admits_kv_ports_only_from_the_apps_own_pods(variant):
    docs = _template(f"variant={variant}")
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for pod in _pods(service):  # the policy covers every Ray pod of the app
        assert selector.items() <= pod["metadata"]["labels"].items()
    own = [r for r in policy["spec"]["ingress"] if "from" in r]
    assert own == [{"from": [{"podSelector": {"matchLabels": selector}}]}]  # the app's pods: every port
    side_channel = 5600  # vllm.envs.VLLM_NIXL_SIDE_CHANNEL_PORT's default
    assert not _open_tcp(policy, side_channel)
    for port in (8000, 8265, 10001, 6379, 8080, 52365, 1, 65535):  # everything else as without a policy
        assert _open_tcp(policy, port), port


def test_the_chart_secret_holds_a_random_kv_secret_and_the_policy_can_be_turned_off():
    docs = _template("variant=gpu")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert set(secret["data"]) == {"auth_token", KV_SECRET_KEY}
    again = [d for d in _template("variant=gpu") if d["kind"] == "Secret"][0]
    assert again["data"][KV_SECRET_KEY] != secret["data"][KV_SECRET_KEY], "random per install"
    kinds = {d["kind"] for d in _template("variant=gpu", "networkPolicy.enabled=false", "grafanaDashboard.enabled=false")}
    assert kinds == {"RayService", "Secret"}


def test_the_secret_command_prints_a_kv_secret_too():
    def secret():
        out = subprocess.run([sys.executable, "-m", "prefillshare.app.kube", "secret"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)["stringData"][KV_SECRET_KEY]

    first = secret()
    assert len(first) >= 32 and secret() != first
