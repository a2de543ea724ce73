"""The engine replicas: the shared prefill group (PrefillServer) and the decode groups
(DecodeServer), each one vLLM engine on its own resource bundle."""
