# The README's two commands: `make serve` and `make test`. Both set up .venv first.
SHELL := /bin/bash
VENV := .venv/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup serve test

setup:
	@bash scripts/setup.sh

serve: setup
	@bash scripts/serve.sh

test: setup
	@bash scripts/test.sh
