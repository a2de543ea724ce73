"""A request's path below the ingress: the Orchestrator's agent runs, the fan-out (one prefill, N
decoder calls) and the engine deployments as the path calls them."""
