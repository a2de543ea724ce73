"""Serve request routers: prefix locality for prefill replicas, node affinity for decode replicas,
over a base that never loses a request."""
