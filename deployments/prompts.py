"""Token ids of the prompts the app sends to engines, rendered the way each decoder was trained.

Every decoder's manifest records its prompt format (``prompt`` block: the suite's
``context\\ninstruction``, plain text, or a chat template by sha256). :meth:`Prompter.from_config`
rebuilds each decoder's :class:`prefillshare.app.rendering.Renderer` at deploy time, and refuses a
decoder whose rendering it cannot reproduce (template file missing or with another hash,
template that does not render). ``agent_prompt``/``chat_prompt`` with ``model=`` then produce
exactly the token ids training produced for the same request. The shared part of a fan-out is
the longest common token prefix (computed, never assumed from the text): agent requests put
the shared context first; shared-first decoders put every agent's own text (system prompt,
tools) after it too, so agents with different system prompts still share it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefillshare.app.rendering import Renderer, RenderError
from prefillshare.app.sharing import common_prefix

__all__ = ["Prompter", "RenderError", "common_prefix"]


class Prompter:
    """Requests -> token ids. ``renderers`` maps served decoder names to their Renderer; a model not
    in it (or ``model=None``) renders the suite way, the format of the shipped decoders."""

    def __init__(self, tokenizer_path: str, renderers: Mapping[str, Renderer] | None = None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)  # token-id prompts must stay below this
        self.renderers: dict[str, Renderer] = dict(renderers or {})  # checked when the plan was built

    @classmethod
    def from_config(cls, cfg) -> Prompter:
        """Built from an AppConfig: the app tokenizer plus every decoder's recorded rendering.
        Raises RenderError (deploy time) for a rendering it cannot reproduce."""
        from prefillshare.app.plan import decoder_renderers

        return cls(str(cfg.path(cfg.tokenizer)), decoder_renderers(cfg))

    def renderer(self, model: str | None) -> Renderer:
        return self.renderers.get(model, _SUITE) if model is not None else _SUITE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids as the engines' tokenizer makes them (BOS from the post-processor unless
        ``add_special_tokens`` is off)."""
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def agent_prompt(self, context: str, instruction: str, model: str | None = None) -> list[int]:
        """One agent's prompt: the shared context first, then its instruction, in ``model``'s format."""
        return self.renderer(model).agent_ids(self.tok, context, instruction)

    def chat_prompt(self, messages: Sequence[tuple[str, str]], model: str | None = None,
                    tools_line: str | None = None, **switches) -> list[int]:
        """(role, content) text turns ending in a user turn -> prompt ids in ``model``'s format and
        layout: its chat template with the generation prompt, or (suite) earlier turns as context
        lines and the last turn as the instruction; a shared-first decoder gets its system turns and
        ``tools_line`` after the shared conversation. ``switches``: vLLM's chat-template switches
        (Renderer.chat_ids)."""
        if not messages:
            raise RenderError("messages: at least one message is needed")
        return self.renderer(model).chat_ids(self.tok, messages, tools_line=tools_line, **switches)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


_SUITE = Renderer()
