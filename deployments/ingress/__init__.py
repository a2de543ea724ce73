"""The HTTP ingress: the Router deployment (OpenAI and agent routes) and what it needs to turn a
request body into token ids and sampling, and engine output back into OpenAI shapes."""
