"""Token ids of the prompts the app sends to engines, built with the project's template.

Agent prompts are tokenized whole with `app.training.tasks.render_prompt`, exactly as in
training, so a served decoder sees the token ids it was trained on. The shared part of a
fan-out is then the longest common token prefix (computed, never assumed from the text).
"""
from __future__ import annotations

from collections.abc import Sequence

from app.engine.kv_keys import block_keys
from app.training.tasks import render_prompt


class Prompter:
    def __init__(self, tokenizer_path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)  # token-id prompts must stay below this

    def encode(self, text: str) -> list[int]:
        """Ids as the engines' tokenizer makes them (BOS from the post-processor)."""
        return list(self.tok(text)["input_ids"])

    def agent_prompt(self, context: str, instruction: str) -> list[int]:
        return self.encode(render_prompt(context, instruction))

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Chat turns -> (context, instruction): the last user turn is the instruction,
        every earlier turn's content joins the context, one line each."""
        *earlier, (_, last) = messages
        context = "\n".join(content for _, content in earlier)
        return self.agent_prompt(context, last)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Longest token prefix shared by every prompt."""
    if not prompts:
        return []
    first = prompts[0]
    n = min(len(p) for p in prompts)
    i = 0
    while i < n and all(p[i] == first[i] for p in prompts):
        i += 1
    return list(first[:i])


def locality_keys(prefill_module_id: str, token_ids: Sequence[int], block_size: int,
                  cache_salt: str | None = None) -> tuple[str, ...]:
    """Keys (app.engine.kv_keys, the project's one scheme) of the full blocks of ``token_ids``:
    what the prefix router routes on. A trailing partial block is left out: its key changes
    with every suffix, so it carries no locality."""
    return tuple(k.key for k in block_keys(prefill_module_id, cache_salt, list(token_ids), block_size) if k.full)
