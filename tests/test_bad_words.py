"""bad_words in every form: the ingress's tokenization (app/bad_words.py) and the engine's logits
processor (app/engine/bad_words.py) on vLLM's public V1 interface, with its canary. No engine; the
served check is tests/keyless_app/test_vllm_compat.py::test_bad_words_bans_the_form_vllms_own_rule_misses."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from prefillshare.app.bad_words import EXTRA_ARG, PROCESSOR, word_sequences
from prefillshare.app.sampling import Sampling, to_sampling_params

ROOT = Path(__file__).resolve().parent.parent


def test_both_forms_of_a_word_are_banned_whatever_their_lengths():
    from prefillshare.app.training.tokenizer import load_tokenizer

    tok = load_tokenizer(ROOT / "checkpoints" / "base")

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    bare, spaced = encode("lamp"), encode(" lamp")
    assert len(bare) != len(spaced)  # the shipped tokenizer: vLLM's own rule keeps the bare form only
    assert word_sequences(encode, ["lamp", " lamp", "rome"]) == (
        tuple(bare), tuple(spaced), tuple(encode("rome")), tuple(encode(" rome")))
    params = to_sampling_params(Sampling(bad_words=("lamp",), bad_word_ids=word_sequences(encode, ["lamp"])))
    assert params.bad_words == [] and params.extra_args[EXTRA_ARG] == [bare, spaced]
    plain = to_sampling_params(Sampling(bad_words=("lamp",)))  # not tokenized by the ingress: vLLM's own rule
    assert plain.bad_words == ["lamp"] and not (plain.extra_args or {}).get(EXTRA_ARG)


def _update(added=(), removed=(), moved=(), size=4):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def test_the_processor_masks_the_token_that_completes_a_banned_sequence_per_request():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import MoveDirectionality

    from prefillshare.app.engine.bad_words import BadWordSequences

    proc = BadWordSequences(None, torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is False  # greedy requests must see it too
    out0, out1, out2 = [], [5], [7]
    banned = SamplingParams(extra_args={EXTRA_ARG: [[9], [5, 6]]})
    proc.update_state(_update(added=[(0, banned, [1], out0), (1, banned, [1], out1), (2, SamplingParams(), [1], out2)]))
    logits = proc.apply(torch.zeros(3, 10))
    assert logits[0, 9] == float("-inf") and logits[0, 6] == 0  # 6 only after 5
    assert logits[1, 9] == float("-inf") and logits[1, 6] == float("-inf")
    assert torch.isfinite(logits[2]).all()  # a request without bad words is untouched
    out0.append(5)  # the live output list: the next step sees it
    assert proc.apply(torch.zeros(3, 10))[0, 6] == float("-inf")
    proc.update_state(_update(moved=[(0, 2, MoveDirectionality.SWAP)]))
    logits = proc.apply(torch.zeros(3, 10))
    assert torch.isfinite(logits[0]).all() and logits[2, 9] == float("-inf")
    proc.update_state(_update(moved=[(2, 3, MoveDirectionality.UNIDIRECTIONAL)], removed=[1]))
    logits = proc.apply(torch.zeros(4, 10))
    assert torch.isfinite(logits[:3]).all() and logits[3, 9] == float("-inf")
    proc.update_state(None)  # no change this step


def test_canary_vllms_logits_processor_interface_and_loader():
    """What the processor relies on in vLLM 0.32: a failure names what moved."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.sample import logits_processor as lp

    from prefillshare.app.engine.bad_words import BadWordSequences

    assert {"apply", "is_argmax_invariant", "update_state"} <= set(lp.LogitsProcessor.__abstractmethods__), \
        "vllm.v1.sample.logits_processor.LogitsProcessor: abstract methods changed"
    assert list(inspect.signature(lp.LogitsProcessor.__init__).parameters) == [
        "self", "vllm_config", "device", "is_pin_memory"], "LogitsProcessor.__init__ signature changed"
    assert [f for f in lp.BatchUpdate.__dataclass_fields__] == ["batch_size", "removed", "added", "moved"], \
        "BatchUpdate fields changed"
    assert {m.name for m in lp.MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}, "MoveDirectionality changed"
    assert lp._load_logitsprocs_by_fqcns([PROCESSOR]) == [BadWordSequences], \
        "vllm.v1.sample.logits_processor._load_logitsprocs_by_fqcns no longer loads '<module>:<type>'"
    assert "logits_processors" in AsyncEngineArgs.__dataclass_fields__, "AsyncEngineArgs.logits_processors is gone"
    assert "extra_args" in inspect.signature(__import__("vllm").SamplingParams).parameters, \
        "SamplingParams(extra_args=...) is gone"


def test_every_engine_runs_the_processor_beside_a_users_own():
    from prefillshare.app.engine.async_engine import EngineConfig

    args = EngineConfig(model=str(ROOT / "checkpoints" / "base")).engine_args()
    assert args.logits_processors == [PROCESSOR]
    mine = EngineConfig(model=str(ROOT / "checkpoints" / "base"),
                        engine_kwargs={"logits_processors": ["my.module:Mine"]}).engine_args()
    assert mine.logits_processors == [PROCESSOR, "my.module:Mine"]
