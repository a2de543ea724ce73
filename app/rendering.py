"""Prompt rendering: one function from a request (or a training record) to token ids.

Training renders every record with a :class:`Renderer` built from the decoder's prompt format
and records that format in the manifest; serving (deployments/prompts.py) rebuilds the same
Renderer from the manifest, so the token ids of a request are the ids the decoder was trained
on. Three formats (``PromptFormat``): the suite's ``context\\ninstruction``, plain
prompt/completion text, and a Jinja chat template applied with ``add_generation_prompt``.

Two layouts (``PromptFormat.layout``, :meth:`Renderer.arrange`): agent frameworks send each
agent's system prompt and tools first, so N agents over one conversation share no prefix.
A ``shared_first`` decoder was trained with the agent's own text after the shared
conversation (appended to the last user turn, which every chat template renders), so the
shared part is one prefill for all of them. ``system_first`` renders the messages as sent.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefillshare.app.errors import PrefillShareLibraryError
from prefillshare.app.models.manifest import MANIFEST_NAME, DecodeManifest, PromptFormat, read_manifest

Messages = Sequence[tuple[str, str]]  # (role, content) text pairs
TEMPLATE_FILE = "chat_template.jinja"
# a conversation every usable template must render (deploy-time and train-time check)
PROBE = (("system", "probe system"), ("user", "probe user"), ("assistant", "probe answer"), ("user", "probe again"))
OWN_ROLES = ("system", "developer")  # turns that are one agent's own text, not the shared conversation


class RenderError(PrefillShareLibraryError, ValueError):
    """A prompt cannot be rendered the recorded way; the message names the file or decoder."""


class SwitchIgnored(RenderError):
    """A chat switch the decoder's rendering would leave without effect; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def template_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def join_suite(context: str, instruction: str) -> str:
    """The suite's prompt text (``prefillshare.app.training.tasks.render_prompt``)."""
    return f"{context}\n{instruction}"


@dataclass(frozen=True)
class Renderer:
    """How prompts become token ids for one decoder. Plain strings: it crosses process boundaries."""

    fmt: PromptFormat = PromptFormat()
    template: str | None = None  # the Jinja text, chat_template only

    def __post_init__(self):
        if self.fmt.format == "chat_template":
            if not self.template:
                raise RenderError("a chat_template rendering needs the template text")
            if self.fmt.template_sha256 != template_sha256(self.template):
                raise RenderError(f"template sha256 {template_sha256(self.template)} does not match the recorded "
                                  f"{self.fmt.template_sha256}")

    @classmethod
    def chat(cls, template: str, system: str | None = None, layout: str = "shared_first") -> Renderer:
        return cls(PromptFormat("chat_template", template_sha256(template), TEMPLATE_FILE, system, layout), template)

    @classmethod
    def for_decoder(cls, decoder_dir: str | Path, manifest: DecodeManifest | None = None) -> Renderer:
        """The rendering recorded in a decoder's manifest, with its template file verified."""
        decoder_dir = Path(decoder_dir)
        manifest = manifest or read_manifest(decoder_dir)
        fmt = manifest.prompt
        if fmt.format != "chat_template":
            return cls(fmt)
        if fmt.template_file is None or fmt.template_sha256 is None:
            raise RenderError(f"{decoder_dir / MANIFEST_NAME}: prompt format chat_template without template_file "
                              "and template_sha256")
        path = decoder_dir / fmt.template_file
        if not path.is_file():
            raise RenderError(f"{decoder_dir / MANIFEST_NAME}: prompt.template_file {fmt.template_file!r} is not in "
                              f"{decoder_dir}")
        text = path.read_text(encoding="utf-8")
        if template_sha256(text) != fmt.template_sha256:
            raise RenderError(f"{path}: unknown template: its sha256 {template_sha256(text)[:16]}... is not the "
                              f"{fmt.template_sha256[:16]}... recorded in {MANIFEST_NAME} (the decoder was trained "
                              "with another template)")
        return cls(fmt, text)

    @property
    def format(self) -> str:
        return self.fmt.format

    @property
    def shared_first(self) -> bool:
        return self.fmt.layout == "shared_first"

    def arrange(self, messages: Messages, tools_line: str | None = None) -> list[tuple[str, str]]:
        """``messages`` (and the request's tools, as one line) in the layout the decoder was trained on.

        system_first: as sent, the tools line first as a system turn. shared_first: every system
        or developer turn and the tools line leave their place and are appended, in that order,
        to the last user turn, after the shared conversation; later turns (the agent's own tool
        calls and results) follow unchanged. Nothing is dropped, only moved.
        """
        if not self.shared_first:
            return [("system", tools_line), *messages] if tools_line else list(messages)
        own = [c for r, c in messages if r in OWN_ROLES and c]
        own += [tools_line] if tools_line else []
        rest = [(r, c) for r, c in messages if r not in OWN_ROLES]
        users = [i for i, (r, _) in enumerate(rest) if r == "user"]
        if not own:
            return rest
        if not users:  # no shared conversation to follow: the agent's text is the whole user turn
            return [("user", "\n".join(own)), *rest]
        i = users[-1]
        rest[i] = (rest[i][0], "\n".join([rest[i][1], *own]))
        return rest

    def extra_files(self) -> dict[str, str]:
        """Files an exported decoder carries so the rendering can be rebuilt from its directory."""
        if self.format != "chat_template" or self.fmt.template_file is None or self.template is None:
            return {}
        return {self.fmt.template_file: self.template}

    # --- chat templates ---
    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads (none without a template): the switches it can honour."""
        if self.format != "chat_template" or not self.template:
            return frozenset()
        import jinja2
        import jinja2.meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # as transformers renders templates
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.template)))

    def check_switches(self, add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                       continue_final_message: bool = False) -> None:
        """Refuse a chat switch this rendering would ignore (:class:`SwitchIgnored` naming the field):
        ``add_generation_prompt: false`` where no generation prompt is rendered (unless it goes with
        ``continue_final_message``, which needs it), and each ``chat_template_kwargs`` key the
        template does not read (or any, without a template)."""
        reads = self.template_variables
        if not add_generation_prompt and not continue_final_message and "add_generation_prompt" not in reads:
            raise SwitchIgnored("add_generation_prompt", "false has no effect on this decoder: its rendering ("
                                f"{self._described}) adds no generation prompt to leave out")
        for key in template_kwargs or {}:
            if key not in reads:
                raise SwitchIgnored(f"chat_template_kwargs.{key}", f"this decoder's rendering ({self._described}) "
                                    f"does not read {key!r}")

    @property
    def _described(self) -> str:
        return "its chat template" if self.format == "chat_template" else f"the {self.format} format, no template"

    def _render(self, tok, messages: Messages, add_generation_prompt: bool, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
        try:
            text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], chat_template=self.template,
                                           add_generation_prompt=add_generation_prompt, tokenize=False,
                                           continue_final_message=continue_final_message, **(template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - jinja raises many types; all mean "cannot render"
            raise RenderError(f"chat template does not render: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise RenderError(f"chat template rendered {type(text).__name__}, not text")
        return text

    def _ids(self, tok, text: str) -> list[int]:
        # templates write their own special tokens (bos, turn markers): no post-processor additions
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def check(self, tok, where: str) -> None:
        """Raise RenderError (naming ``where``) unless this rendering works with ``tok``."""
        if self.format != "chat_template":
            return
        try:
            prompt = self._render(tok, self.arrange(PROBE), True)
            self._split(tok, self.arrange([*PROBE, ("assistant", "probe reply")]))
        except RenderError as e:
            raise RenderError(f"{where}: {e}") from None
        if not self._ids(tok, prompt):
            raise RenderError(f"{where}: chat template renders an empty prompt")

    def _split(self, tok, messages: Messages) -> tuple[str, str]:
        prompt = self._render(tok, messages[:-1], True)
        full = self._render(tok, messages, False)
        if not full.startswith(prompt):
            raise RenderError("chat template does not render the final assistant turn as a continuation of the "
                              "generation prompt (add_generation_prompt)")
        return prompt, full[len(prompt):]

    # --- the three entry points ---
    def chat_ids(self, tok, messages: Messages, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, template_kwargs: dict | None = None,
                 tools_line: str | None = None) -> list[int]:
        """A conversation ending in a user turn -> prompt ids (generation prompt included unless
        ``add_generation_prompt`` is off), in the decoder's layout (:meth:`arrange`).
        ``continue_final_message``: the conversation ends in a partial assistant turn, which the
        prompt leaves open. ``template_kwargs`` reach a chat template (the suite and text formats
        have none to read them)."""
        self.check_switches(add_generation_prompt, template_kwargs, continue_final_message)
        return self._arranged_ids(tok, self.arrange(messages, tools_line), add_generation_prompt,
                                  continue_final_message, template_kwargs)

    def _arranged_ids(self, tok, messages: Messages, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        if self.format == "chat_template":
            return self._ids(tok, self._render(tok, messages, add_generation_prompt, continue_final_message,
                                               template_kwargs))
        if continue_final_message:  # the answer so far, as training puts an answer after its prompt
            *head, (_, partial) = messages
            sep = " " if self.format == "suite" else ""
            return self._arranged_ids(tok, head) + list(tok(sep + partial, add_special_tokens=False)["input_ids"])
        *earlier, (_, last) = messages  # suite/text: earlier turns are the context, one line each
        text = join_suite("\n".join(c for _, c in earlier), last) if earlier else last
        return list(tok(text)["input_ids"])

    def agent_messages(self, context: str, instruction: str) -> list[tuple[str, str]]:
        """An agent request as a conversation, as an agent framework would send it.

        shared_first: the agent's system prompt and instruction are its own text (one system
        turn) and the context the shared user turn, so the prompt is ``context``, then the
        system prompt, then the instruction (``context\\ninstruction`` without a system prompt).
        system_first: ``[system] + user(context\\ninstruction)``.
        """
        if self.shared_first:
            own = "\n".join(t for t in (self.fmt.system, instruction) if t)
            return [("system", own), ("user", context)] if own else [("user", context)]
        system = [("system", self.fmt.system)] if self.fmt.system else []
        return [*system, ("user", join_suite(context, instruction))]

    def agent_ids(self, tok, context: str, instruction: str) -> list[int]:
        return self.chat_ids(tok, self.agent_messages(context, instruction))

    def training_ids(self, tok, messages: Messages) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of a conversation ending in the assistant turn to learn.

        The response is what the decoder must generate after the prompt, ending in eos (the token
        serving stops at): the template's continuation for chat templates, ``" answer"`` for the
        suite, the completion as written for text.
        """
        eos = tok.eos_token_id
        if eos is None:
            raise RenderError("the tokenizer has no eos token: a decoder could never end its answer")
        messages = self.arrange(messages)
        *prompt_msgs, (_, answer) = messages
        if self.format == "chat_template":
            prompt, rest = self._split(tok, messages)
            p_ids, r_ids = self._ids(tok, prompt), self._ids(tok, rest)
        else:
            p_ids = self._arranged_ids(tok, prompt_msgs)
            r_ids = list(tok((" " if self.format == "suite" else "") + answer, add_special_tokens=False)["input_ids"])
        return p_ids, _end_with_eos(r_ids, eos)

    def text_ids(self, tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of a prompt/completion record: the texts as written."""
        if tok.eos_token_id is None:
            raise RenderError("the tokenizer has no eos token: a decoder could never end its answer")
        r_ids = list(tok(completion, add_special_tokens=False)["input_ids"])
        return list(tok(prompt)["input_ids"]), _end_with_eos(r_ids, tok.eos_token_id)


def _end_with_eos(ids: list[int], eos: int) -> list[int]:
    """Up to and including the first eos (what serving stops at), eos appended when absent."""
    return ids[: ids.index(eos) + 1] if eos in ids else [*ids, eos]
