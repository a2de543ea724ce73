"""The ``vllm-nixl`` hand-over: vLLM's NixlConnector (config, guarded connector, side-channel
auth, transport, version pairing) and the leases it lends; :mod:`.handover` is its side of the
app's hand-over seam."""
