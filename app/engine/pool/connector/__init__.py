"""PrefillShareConnector: a vLLM KV connector through which decoders of other models use a base's KV.

vLLM loads it with ``kv_connector="PrefillShareConnector"``,
``kv_connector_module_path="prefillshare.app.engine.pool.connector"``; :func:`prefillshare.app.engine.pool.handover.connector_config`
builds that config (the app's ``pool`` hand-over, :class:`prefillshare.app.engine.pool.handover.PoolHandover`).

It is split as vLLM splits its own connectors:

- :mod:`.facade`: the ``KVConnectorBase_V1`` vLLM calls; it holds one half per role.
- :mod:`.scheduler`: which tokens a request takes from the store, what a producer saves, the
  reasons for private prefills. Pure Python over the store's index; unit-tested with fake
  requests (tests/test_connector_scheduler.py).
- :mod:`.worker`: the byte copies between the paged KV cache and the store's slab.
- :mod:`.metadata`: the settings both read and the per-step message between them.

The store behind both (:class:`prefillshare.app.engine.pool.kv_pool.KVPool`) is the node's shared-memory pool
(across nodes the KV moves with vLLM's NixlConnector instead: :mod:`prefillshare.app.engine.nixl`).

Producer (the base's engine): when a request's prefill completes, every block covering
``prompt[:-1]`` (hand-over convention, :mod:`prefillshare.app.prompt_split`), including the trailing partial
block, is saved under :mod:`prefillshare.app.engine.pool.kv_keys` keys; ``kv_transfer_params={"fanout": N}``
pins them until N decoders loaded them. Consumer (a decoder's engine): only a complete match
of ``prompt[:-1]`` is loaded (the decoder was trained on base KV for every prompt token but
the last), and the decoder computes exactly the last prompt token itself.

Anything else is a private prefill, counted per scope: ``fallback:missing`` (never saved,
evicted or partly evicted), ``fallback:reused`` (a slot reused
after eviction while it was being loaded), ``fallback:torn`` (a slot whose writer did not
finish: producer died mid-save), ``fallback:damaged`` (crc32 mismatch, ``check="crc32"``
only), ``fallback:layout``.

Consumers should run without local prefix caching (``EngineConfig`` does this by default):
a locally cached block of a decoder may hold KV the decoder computed itself (after a fallback),
which would silently break the hand-over convention on a later request.
"""
from prefillshare.app.engine.pool.connector.facade import PrefillShareConnector
from prefillshare.app.engine.pool.connector.metadata import (
           ConnectorConfigError,
           ConnectorSettings,
           LoadSpec,
           PrefillShareMeta,
           SaveSpec,
)

__all__ = ["PrefillShareConnector", "PrefillShareMeta", "LoadSpec", "SaveSpec", "ConnectorSettings",
           "ConnectorConfigError"]
