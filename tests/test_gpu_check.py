"""bench/gpu_check.py, the GPU check, as CPU dry runs and against the lent box's limits.

On a GPU the same steps run vLLM's NixlConnector between two engines on the device with the app's
own NIXL settings; here they check that the script runs end to end, that its JSON names the
versions and the transports, that the pulled KV gives the reference's tokens (a full decoder and a
LoRA adapter consumer), and that its time limits and payload chunks fit the box (one call of at
most 7.5 minutes, at most 64 MiB carried per call).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_its_time_limits_fit_one_call_of_seven_and_a_half_minutes():
    gc = _module()
    steps = sum(gc.STEPS[k][1] for k in gc.DEFAULT_STEPS)
    assert steps <= gc.BUDGET_S
    wrapper = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    bounds = [int(n) for n in re.findall(r"timeout (\d+)", wrapper)]  # the payload's unpacking, the steps
    assert len(bounds) == 2 and bounds[1] >= gc.BUDGET_S
    assert sum(bounds) <= 450, bounds


def test_its_payload_chunks_fit_the_carry_limit_beside_the_tree(tmp_path):
    """A chunk the 64 MiB carry limit cannot take beside the working tree is refused before any
    download."""
    r = subprocess.run(["bash", "bench/gpu_payload.sh", str(tmp_path / "p"), "64"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "does not fit beside the" in r.stderr, r.stderr


def test_env_and_transport_steps_dry_run_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--steps", "env,transport",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not res["failures"]
    versions = res["environment"]["versions"]
    assert versions["torch"] and versions["vllm"] and versions["python"]
    rows = res["transport"]["rows"]
    assert {row["shape"] for row in rows} == {"8B", "100M"}
    for row in rows:
        assert row["bytes_equal"]
        for k in ("device_gather_gb_s", "device_scatter_gb_s", "ipc_scatter_gb_s", "host_save_gb_s",
                  "host_load_gb_s", "device_copy_gb_s"):
            # a rate a CPU's memory can give: a timer or unit slip (bytes, ns) lands outside
            assert 0.01 < row[k] < 2000, (k, row[k])


def _dry_run(tmp_path, steps: str, timeout: int) -> dict:
    """bench/gpu_check.py's ``steps`` on the CPU, passed with no failure: its JSON."""
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--steps", steps,
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not res["failures"]
    return res


@pytest.mark.engine
def test_in_engine_step_dry_run_on_cpu(tmp_path):
    """The in_engine step on the CPU: the shipped chat adapters in the base's own engine answer as
    transformers' hand-over, base requests beside them as the base, and a fan-out of the four over one
    prompt computes about one prompt (vLLM's counters) while another tenant reads nothing."""
    probe = _dry_run(tmp_path, "in_engine", 600)["in_engine"]
    assert probe["tokens"]["compared"] == 32 and not probe["tokens"]["mismatches"]
    assert probe["tokens"]["whole_prompt_differs"] >= 1
    share = probe["sharing"]
    assert sorted(share["cached_tokens"])[1:] == [share["expected_cached_after_first"]] * 3
    assert 1.0 <= share["computed_over_one_prompt"] <= 1.1 and share["other_tenant_cached"] == 0


@pytest.mark.engine
def test_handover_steps_dry_run_on_cpu(tmp_path):
    """The vllm-nixl steps on the CPU with the app's CPU settings: the shipped base and a decoder
    with other weights, then a LoRA adapter consumer, one 300-token prompt each; then a toy dummy
    Llama's TTFT and GB/s against a copy of the same bytes (two engine processes per step)."""
    res = _dry_run(tmp_path, "env,tokens,lora,speed", 1500)
    steps = res["handover"]
    for name in ("tokens", "lora"):
        step = steps[name]
        assert step["setting"] == "polled" and step["app_setting"]
        (row,) = step["summary"].values()
        assert row["tokens_equal"] and row["all_pulled"]
        assert 0 < row["second_prefill_computed"] <= 32  # the prefix cache served the rest of the prompt
        assert step["kv_transfer"]["mib"] > 0 and step["handover_counters"]["pulls"] >= 2
        assert "host memory" in step["transport_planned"]
        assert step["transport_logged"], "each engine logs its transport when its connector starts"
        # UCX's own protocol table for the reads (UCX_PROTO_INFO): on one CPU host, CMA (measured here)
        assert step["transport_chosen"] and step["ucx_version"].startswith("Version ")
    speed = steps["speed"]
    # bounds that a broken measurement leaves: a KV pull is not 10x faster than a plain copy of its
    # bytes, and a decoder's TTFT after its own prefill is neither 20x below nor 100x above one that
    # pulled the base's KV (a zero or a unit slip in either lands outside)
    assert 0.01 < speed["copy_gb_s"] < 2000 and 0 < speed["kv_over_copy"] <= 10, speed
    (row,) = speed["summary"].values()
    assert 0.05 < row["ttft_private_over_shared"] < 100 and row["all_pulled"], row
    assert (tmp_path / "speed.log").is_file()
    assert set(res["ratios"]) == {"speed: decoder TTFT private / shared", "speed: KV GB/s / device copy GB/s"}
