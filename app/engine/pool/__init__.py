"""The ``pool`` hand-over: the node's shared-memory KV pool (kv_pool, slab, keys, owner) and the
project's vLLM connector over it; :mod:`.handover` is its side of the app's hand-over seam."""
