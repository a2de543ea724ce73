"""One vLLM per app: a producer's lease names its vLLM; a consumer of another version refuses it
(the Decode replica's check and the connector's), naming both versions."""
import time

from prefillshare.app.engine.nixl import leases as ho
from prefillshare.app.engine.nixl import vllm_pairing


def test_a_stamped_lease_pairs_only_with_the_same_vllm():
    params = vllm_pairing.stamp({"do_remote_prefill": True, "remote_block_ids": [1]}, version="0.26.0")
    assert params[vllm_pairing.VERSION_KEY] == "0.26.0"
    assert vllm_pairing.stamp(None) is None
    assert vllm_pairing.refusal(params, version="0.26.0") is None
    err = vllm_pairing.refusal(params, version="0.32.0")
    assert isinstance(err, vllm_pairing.VllmVersionMismatch)
    assert (err.producer, err.consumer) == ("0.26.0", "0.32.0")
    assert "0.26.0" in str(err) and "0.32.0" in str(err)
    assert vllm_pairing.refusal({"do_remote_prefill": True}, version="0.32.0") is None  # an unstamped producer


def test_the_decode_replica_prefills_privately_on_a_lease_of_another_vllm():
    ours = vllm_pairing.vllm_version()
    params = {"do_remote_prefill": True, "remote_block_ids": [0]}
    good = ho.Lease(vllm_pairing.stamp(params, version=ours), time.time() + 60, 10, 10, "p0")
    other = ho.Lease(vllm_pairing.stamp(params, version=ours + ".other"), time.time() + 60, 10, 10, "p1")
    assert ho.pull_params(good, margin_s=3)[1] is None
    assert ho.pull_params(other, margin_s=3) == (None, "vllm_version")
    counters = ho.HandoverCounters()
    assert ho.count_decode(counters, "vllm_version", 10, 0) == "fallback:vllm_version"
    assert counters.as_dict()["fallback:vllm_version"] == 1


def test_the_connector_refuses_a_pull_from_another_vllm_and_stamps_its_own_leases(monkeypatch):
    """The project's NixlConnector around vLLM's: no pull of another vLLM's blocks (the request is
    computed here), and a finished prefill's params carry this vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as VllmNixl

    from prefillshare.app.engine.nixl.connector import NixlConnector

    seen = {}

    def matched(self, request, num_computed_tokens):
        seen["do_remote_prefill"] = request.kv_transfer_params["do_remote_prefill"]
        return 0, False

    monkeypatch.setattr(VllmNixl, "get_num_new_matched_tokens", matched)
    monkeypatch.setattr(VllmNixl, "request_finished", lambda self, req, blocks: (True, {"do_remote_decode": False}))
    conn = NixlConnector.__new__(NixlConnector)  # the halves are not needed for these two calls

    class Req:
        request_id = "r1"
        kv_transfer_params = vllm_pairing.stamp({"do_remote_prefill": True, "remote_block_ids": [3]}, version="0.0.1")

    assert conn.get_num_new_matched_tokens(Req(), 0) == (0, False)
    assert seen["do_remote_prefill"] is False  # refused: vLLM computes the prompt
    Req.kv_transfer_params = vllm_pairing.stamp({"do_remote_prefill": True}, version=vllm_pairing.vllm_version())
    conn.get_num_new_matched_tokens(Req(), 0)
    assert seen["do_remote_prefill"] is True
    delay, params = conn.request_finished(Req(), [1, 2])
    assert delay is True and params[vllm_pairing.VERSION_KEY] == vllm_pairing.vllm_version()
