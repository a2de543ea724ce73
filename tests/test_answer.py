"""OpenAI answers built from the one accumulator (deployments/path/decode_call.py Output) and the one
Failure -> HTTP / agent-result mapping (deployments/errors.py), without Ray or engines."""
from __future__ import annotations

import pytest

from prefillshare.app.sampling import Sampling, TokenLogprob
from prefillshare.deployments.errors import INPUT_FIELD, ApiError, ErrorCode, Failure, failure_fields
from prefillshare.deployments.ingress.openai_format import Answer
from prefillshare.deployments.messages import CompletionJob, DecodeChunk
from prefillshare.deployments.path.decode_call import Output


def _feed(out: Output, *chunks: DecodeChunk) -> None:
    for c in chunks:
        out.add(c)


def test_usage_choices_and_prefill_fields_come_from_the_output():
    job = CompletionJob("cmpl-1", "alpha", (1, 2, 3, 4), Sampling(max_tokens=4, n=2, temperature=1.0), "completions")
    out = Output(prefill_module="base", prefill_replica="r1")
    _feed(out, DecodeChunk("cmpl-1", "alpha", "ab", [7, 8], False, num_cached_tokens=3),
          DecodeChunk("cmpl-1", "alpha", "z", [9], False, "length", num_cached_tokens=3, index=1),
          DecodeChunk("cmpl-1", "alpha", "c", [5], True, "stop", num_cached_tokens=3, stop_reason="\n"))
    answer = Answer(job, False, out, echo="P:")
    body = answer.response(2)
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert [c["text"] for c in body["choices"]] == ["P:abc", "P:z"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["prefillshare"] == {"prefill_module": "base", "prefill_replica": "r1"}


def test_streamed_completion_logprobs_offset_counts_the_echo_and_earlier_text():
    job = CompletionJob("cmpl-2", "alpha", (1, 2), Sampling(max_tokens=4, logprobs=0), "completions")
    out = Output()
    answer = Answer(job, False, out, echo="ab", logprobs=True)
    first = DecodeChunk("cmpl-2", "alpha", "xy", [3], False, logprobs=[TokenLogprob(3, "xy", -0.5)])
    second = DecodeChunk("cmpl-2", "alpha", "z", [4], True, "stop", logprobs=[TokenLogprob(4, "z", -0.1)])
    out.add(first)
    answer.delta_event(first, first=True)
    out.add(second)
    event = answer.delta_event(second, first=False)
    assert '"text_offset": [4]' in event  # "ab" echoed + "xy" before it


@pytest.mark.parametrize("route", sorted(INPUT_FIELD))
def test_a_failure_about_the_input_names_that_routes_field(route):
    for code in (ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH):
        err = ApiError.from_failure(Failure(code, "bad"), route, retry_after_s=3)
        assert (err.status, err.param, err.headers) == (400, INPUT_FIELD[route], None)
    err = ApiError.from_failure(Failure(ErrorCode.OVERLOADED, "busy"), route, retry_after_s=3)
    assert (err.status, err.param, err.headers) == (429, None, {"Retry-After": "3"})


def test_agent_results_carry_the_typed_code_beside_the_message():
    assert failure_fields(None) == {"error": None, "error_code": None}
    f = Failure(ErrorCode.DECODER_UNAVAILABLE, "replica died")
    assert failure_fields(f) == {"error": "decoder_unavailable: replica died", "error_code": "decoder_unavailable"}
