"""scripts/gpu_check.py as CPU dry runs: the torch-only transport step at toy sizes (seconds) and
the vllm-nixl step on two real engine processes (about 100 s).

On a GPU the same steps measure the batched slot copies against plain copies and vLLM's
NixlConnector between two engines on the device; here they check that the script runs end to
end, that every copy path moves exactly the reference's bytes and that the pulled KV gives the
reference's tokens.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transport_step_dry_run_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--steps", "1",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = res["transport"]["rows"]
    assert {row["shape"] for row in rows} == {"8B", "100M"} and not res["failures"]
    for row in rows:
        assert row["bytes_equal"]
        for k in ("device_gather_gb_s", "device_scatter_gb_s", "ipc_scatter_gb_s", "host_save_gb_s",
                  "host_load_gb_s", "per_block_save_gb_s", "per_block_load_gb_s", "device_copy_gb_s"):
            assert row[k] > 0, k


@pytest.mark.engine
def test_vllm_nixl_step_dry_run_on_cpu(tmp_path):
    """Step 5, the GPU check of the vllm-nixl mode, on the CPU: two engine processes over vLLM's
    NixlConnector, the shipped base and a decoder with other weights, one 300-token prompt."""
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--steps", "5",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not res["failures"]
    step = res["vllm_nixl"]
    assert step["vllm"] == version("vllm") and step["setting"] == "polled"
    (row,) = step["equality"]["summary"].values()
    assert row["tokens_equal"] and row["all_pulled"]
    assert 0 < row["second_prefill_computed"] <= 32  # the prefix cache served the rest of the prompt
    assert step["equality"]["kv_transfer"]["mib"] > 0 and step["equality"]["kv_transfer"]["gb_s"] > 0
    assert step["equality"]["handover_counters"]["pulls"] >= 2
