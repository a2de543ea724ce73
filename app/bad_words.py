"""``bad_words`` tokenized once at the ingress, every form a model may generate.

vLLM 0.32 turns each bad word into token sequences itself (``SamplingParams.update_from_tokenizer``):
the word without a leading space, and with one only when that form tokenizes to as many tokens with
another first token. With a byte-level BPE whose vocabulary has ``" lamp"`` as one token and
``"lamp"`` as two, that rule drops the form a model generates mid-sentence, and banning ``lamp``
still yields ``" lamp"`` (measured on the shipped tokenizer). Here both forms are kept whatever
their lengths; app/engine/bad_words.py bans them in the engine.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

EXTRA_ARG = "prefillshare_bad_word_ids"  # SamplingParams.extra_args key: the sequences to ban
PROCESSOR = "prefillshare.app.engine.bad_words:BadWordSequences"  # the logits processor every engine runs


def word_sequences(encode: Callable[[str], list[int]], words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of each word, bare and after one space, each once (first seen first)."""
    seen: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(encode(text))
            if ids:
                seen.setdefault(ids, None)
    return tuple(seen)
