"""The engine half of ``bad_words`` (app/bad_words.py tokenizes them at the ingress).

:class:`BadWordSequences` is a logits processor through vLLM's public V1 interface (the
``logits_processors`` engine argument, per-request ``SamplingParams.extra_args``): the last token
of a banned sequence is masked whenever the tokens generated so far end with the rest of it.
Every engine the project starts runs it (app/engine/async_engine.py). Nothing of vLLM is replaced;
tests/test_bad_words.py is the canary of the interface it implements.
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from prefillshare.app.bad_words import EXTRA_ARG


class BadWordSequences(LogitsProcessor):
    """Masks the token that would complete a banned sequence, per request of the batch."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch index -> (the request's banned sequences, its live list of generated token ids)
        self._rows: dict[int, tuple[list[list[int]], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is the most likely

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            sequences = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
            if sequences:
                self._rows[index] = ([list(s) for s in sequences], output_ids)
            else:
                self._rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self._rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (sequences, output_ids) in self._rows.items():
            for seq in sequences:
                *prefix, last = seq
                if not prefix or output_ids[len(output_ids) - len(prefix):] == prefix:
                    logits[index, last] = float("-inf")
        return logits
