"""vLLM engine wrapper, PrefillShare KV connector, KV pool and transports."""
