"""The project's tokenizer: byte-level BPE trained on the task suite, saved as an HF fast tokenizer.

Byte-level so that any text (a held-out file, a user's prompt) encodes without unknown tokens;
small vocabulary so that the shipped models stay tiny. ``<s>`` is prepended by the tokenizer's
post-processor, so ``AutoTokenizer`` and vLLM tokenize prompts identically.
"""
from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from prefillshare.app.training import tasks

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
DEFAULT_VOCAB_SIZE = 640


def corpus(num_docs: int, seed: int) -> list[str]:
    """Texts the BPE merges are learned from: records, queries, every agent's prompt and answer."""
    rng = random.Random(seed)
    docs = [tasks.pretrain_text(rng)[0] for _ in range(num_docs)]
    for e in tasks.make_examples(num_docs, seed + 1):
        docs.append(e.prompt + tasks.render_response(e.answer))
    # every value word in every position it can take, so each becomes one token
    for values in tasks.FIELDS.values():
        docs.extend(f"{v}: {v} {v}? {v}." for v in values)
    return docs


def train_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0, num_docs: int = 4000):
    """Train and save to ``out_dir`` (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(num_docs, seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1024
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path):
    """The saved tokenizer through ``AutoTokenizer`` (the same way vLLM loads it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
