"""scripts/gpu_check.py's torch-only transport step, as a CPU dry run at toy sizes (seconds).

On a GPU the same step measures the batched slot copies against plain copies; here it checks
that the script runs end to end and that every copy path moves exactly the reference's bytes.
"""
import json
import os
import subprocess
import sys

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
