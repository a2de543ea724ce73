"""The Grafana dashboard the chart ships: provisioned as a labelled ConfigMap (values toggle),
its JSON the file in k8s/chart/dashboards, every panel a PromQL query on names docs/serving.md
documents. That a running app exports each of those names is tests/keyless_app/test_vllm_compat.py."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml
from helm_binary import helm_binary

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "k8s" / "chart"
DASHBOARD = CHART / "dashboards" / "prefillshare.json"


def _configmaps(*sets: str) -> list[dict]:
    out = subprocess.run([helm_binary(), "template", "demo", str(CHART), "-n", "team-a", "--set", "variant=cpu",
                          *sum((["--set", s] for s in sets), [])], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ConfigMap"]


def test_chart_provisions_the_dashboard_for_grafanas_sidecar():
    (cm,) = _configmaps()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "team-a"
    assert json.loads(cm["data"]["prefillshare.json"]) == json.loads(DASHBOARD.read_text())
    (cm,) = _configmaps("grafanaDashboard.label=my_dash", "grafanaDashboard.namespace=monitoring")
    assert "my_dash" in cm["metadata"]["labels"] and cm["metadata"]["namespace"] == "monitoring"
    assert _configmaps("grafanaDashboard.enabled=false") == []


def test_panels_cover_the_issue_and_query_documented_names():
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("first token", "inter-token", "computed vs skipped", "kv pool hits", "fallbacks", "429s"):
        assert topic in titles, topic
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    docs = (ROOT / "docs" / "serving.md").read_text()
    for p in dash["panels"]:
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            for name in re.findall(r"(?:vllm:|prefillshare_)[a-zA-Z0-9_:]+", t["expr"]):
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                assert base in docs, f"{name} (panel {p['title']!r}) is not documented in docs/serving.md"


def test_the_plot_script_evaluates_every_panel_query():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_dashboard", ROOT / "bench" / "plot_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = (0.0, mod.parse('vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="alpha"} 0\n'
                        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="alpha"} 0\n'))
    b = (10.0, mod.parse('vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="alpha"} 10\n'
                         'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="alpha"} 20\n'))
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            mod.evaluate(t["expr"], a, b)  # raises on a form it does not know
    p95 = mod.evaluate(dash["panels"][0]["targets"][0]["expr"], a, b)
    assert p95 == {(("model_name", "alpha"),): 0.1}  # 95% lies past the 0.1 s bucket: its lower edge
