"""SDK against a real local HTTP server speaking the app's API: parsing, streaming, retries,
timeouts, typed errors. (tests/keyless_app/test_sdk_e2e.py runs the SDK against the real Serve app.)"""
from __future__ import annotations

import asyncio
import socket

import pytest

from prefillshare.agents import (
    Agent,
    AgentDelta,
    AgentDone,
    AgentFailedError,
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    Client,
    ContextLengthError,
    Join,
    ModelNotFoundError,
    NotFoundError,
    RoundDone,
    RunDone,
    Sampling,
    ServiceUnavailableError,
    StreamError,
    Workflow,
    WorkflowError,
    join_lines,
)
from tests.sdk_server import AppLikeServer, agent_text

CONTEXT = "order 7 ships to Oslo on Monday ; order 9 ships to Lyon on Friday"
AGENTS = [
    Agent("lookup", "Find where order 7 ships", sampling=Sampling(max_tokens=8)),
    Agent("tool_call", "Call the shipping tool", name="tools"),
    Agent("verify", "Check the dates"),
]


@pytest.fixture()
def server():
    with AppLikeServer() as s:
        yield s


@pytest.fixture()
def client(server):
    with Client(server.url, timeout=5, retries=2, backoff_s=0.01) as c:
        yield c


def test_models(client):
    models = {m.id: m for m in client.models()}
    assert set(models) == {"lookup", "tool_call", "verify"}
    assert models["lookup"].prefill_module == "base"
    assert models["verify"].prefill_module is None and "compatible" in models["verify"].private_prefill_reason


def test_fan_out_typed_results(server, client):
    res = client.run(CONTEXT, AGENTS)
    sent = server.requests[-1][2]
    assert [a["name"] for a in sent["agents"]] == ["lookup", "tools", "verify"]
    assert sent["agents"][0]["max_tokens"] == 8 and "max_tokens" not in sent["agents"][1]
    assert sent["rounds"] == 1 and sent["stream"] is False
    assert [r.name for r in res.results] == ["lookup", "tools", "verify"]
    for agent, r in zip(AGENTS, res.results):
        assert r.text == agent_text(agent.model, agent.instruction, 0)
        assert r.ok and r.model == agent.model and r.usage.completion_tokens == len(r.token_ids)
    assert res["tools"].model == "tool_call"
    assert res["lookup"].shared_prefill and res["lookup"].prefill.module == "base"
    assert not res["verify"].shared_prefill and res["verify"].prefill is None
    shared = len(CONTEXT.split())
    assert res.usage.cached_tokens == 2 * shared and res.usage.shared_prefix_tokens == shared
    assert res.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in res.results)
    assert 0 < res.usage.saved_fraction < 1
    assert res.elapsed_s > 0 and res.texts["verify"] == res["verify"].text
    assert "cache_salt" not in sent
    client.run(CONTEXT, AGENTS, cache_salt="team-a")
    assert server.requests[-1][2]["cache_salt"] == "team-a"


def test_multi_round_joins_outputs(client):
    res = client.run(CONTEXT, AGENTS[:2], rounds=2)
    assert [len(r) for r in res.rounds] == [2, 2]
    assert res.agent("lookup", round=0).text == agent_text("lookup", AGENTS[0].instruction, 0)
    assert res["lookup"].round == 1
    assert res.final_context == CONTEXT + "\n" + "\n".join(f"{r.name}:{r.text}" for r in res.rounds[0])


def test_workflow_server_side_one_request(server, client):
    planner = Agent("lookup", "Plan for {city}", name="planner")
    wf = Workflow.pipeline(planner, AGENTS[1:], Agent("verify", "Sum up", name="aggregate"))
    res = client.run_workflow(wf, CONTEXT, {"city": "Oslo"})
    assert len(server.requests) == 1
    sent = server.requests[0][2]
    assert "agents" not in sent and [len(r) for r in sent["rounds"]] == [1, 2, 1]
    assert sent["rounds"][0][0]["instruction"] == "Plan for Oslo" and sent["join_outputs"] is True
    assert [[r.name for r in rnd] for rnd in res.rounds] == [["planner"], ["tools", "verify"], ["aggregate"]]
    assert "planner:" in res.final_context and "aggregate:" not in res.final_context

    res = client.run_workflow(Workflow(wf.rounds, Join.NONE), CONTEXT, {"city": "Lyon"})
    assert server.requests[-1][2]["join_outputs"] is False and res.final_context == CONTEXT


def test_workflow_client_side_join(server, client):
    def bullet_join(context, results):
        return context + "".join(f"\n- {r.name} said {r.text}" for r in results)

    wf = Workflow.pipeline(AGENTS[0], [AGENTS[2]], join=bullet_join)
    res = client.run_workflow(wf, CONTEXT)
    assert len(server.requests) == 2, "one request per round"
    first, second = server.requests[0][2], server.requests[1][2]
    assert first["context"] == CONTEXT and first["join_outputs"] is False
    assert second["context"] == bullet_join(CONTEXT, res.rounds[0])
    assert [r.round for r in res.results] == [0, 1]
    assert res.final_context == bullet_join(second["context"], res.rounds[1])
    assert res.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in res.results)
    assert join_lines("c", res.rounds[0]) == "c\nlookup:" + res.rounds[0][0].text


def test_definitions_are_checked_before_sending(server, client):
    with pytest.raises(WorkflowError, match="needs variables \\['city'\\]"):
        client.run(CONTEXT, [Agent("lookup", "Plan for {city}")])
    with pytest.raises(WorkflowError, match="repeat"):
        client.run(CONTEXT, [AGENTS[0], AGENTS[0]])
    with pytest.raises(WorkflowError, match="instruction is empty"):
        Agent("lookup", "  ")
    with pytest.raises(WorkflowError, match="temperature"):
        Sampling(temperature=3)
    with pytest.raises(WorkflowError, match="round 1 has no agents"):
        Workflow(((AGENTS[0],), ()))
    assert server.requests == []
    res = client.run(CONTEXT, [{"model": "lookup", "instruction": "Find it", "max_tokens": 4}])
    assert server.requests[-1][2]["agents"][0] == {"name": "lookup", "model": "lookup", "instruction": "Find it",
                                                   "temperature": 0.0, "top_p": 1.0, "max_tokens": 4}
    assert res["lookup"].ok


# ---- errors carry the server's message ---------------------------------------------------------

def test_unknown_model_is_typed(client):
    with pytest.raises(ModelNotFoundError) as e:
        client.run(CONTEXT, [AGENTS[0], Agent("nope", "Find it")])
    assert e.value.status == 404 and e.value.param == "agents[1].model" and e.value.code == "model_not_found"
    assert "served models: lookup" in e.value.message


def test_bad_requests_are_typed(client):
    with pytest.raises(ContextLengthError) as e:
        client.run(CONTEXT, [Agent("lookup", "Find it", sampling=Sampling(max_tokens=100))])
    assert e.value.param == "agents[0].max_tokens"
    with pytest.raises(BadRequestError) as e:
        client.run("   ", AGENTS)
    assert e.value.param == "context" and e.value.message == "context is empty"
    assert not isinstance(e.value, ContextLengthError)
    with pytest.raises(NotFoundError) as e:
        client._json("GET", "/v2/nothing")
    assert e.value.message == "Not Found"


def test_agent_failure_reported_per_agent(client):
    res = client.run(CONTEXT, [AGENTS[0], Agent("verify", "FAIL on purpose")])
    assert res["lookup"].ok and not res["verify"].ok
    assert res["verify"].error.startswith("engine_error")
    with pytest.raises(AgentFailedError) as e:
        res.raise_for_errors()
    assert [f.name for f in e.value.failures] == ["verify"] and "decoder replica died" in str(e.value)


# ---- retries and timeouts ----------------------------------------------------------------------

def test_get_retries_on_503_then_succeeds(server, client):
    server.faults = [("status", 503), ("status", 502)]
    assert len(client.models()) == 3
    assert [r[1] for r in server.requests] == ["/v1/models"] * 3


def test_get_gives_up_after_retries_with_the_server_message(server):
    server.faults = [("status", 503)] * 5
    with Client(server.url, retries=1, backoff_s=0.01) as c:
        with pytest.raises(ServiceUnavailableError) as e:
            c.models()
    assert len(server.requests) == 2 and e.value.message == "engine busy" and e.value.code == "engine_error"


def test_post_not_retried_on_503_but_on_429(server, client):
    server.faults = [("status", 503)]
    with pytest.raises(ServiceUnavailableError):
        client.run(CONTEXT, AGENTS)
    assert len(server.requests) == 1, "a generation that may have started is not re-sent"
    server.faults = [("status", 429, {"Retry-After": "0"})]
    assert client.run(CONTEXT, AGENTS)["lookup"].ok
    assert len(server.requests) == 3


def test_dropped_connection_retried_for_get_only(server, client):
    server.faults = [("drop",)]
    assert client.health()
    assert len(server.requests) == 2
    server.faults = [("drop",)]
    with pytest.raises(APIConnectionError):
        client.run(CONTEXT, AGENTS)
    assert len(server.requests) == 3


def test_connection_refused_is_retried_then_raised():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with Client(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as c:
            with pytest.raises(APIConnectionError) as e:
                c.run(CONTEXT, AGENTS)
    assert not isinstance(e.value, APITimeoutError)


def test_timeout(server, client):
    server.faults = [("delay", 1.5)]
    with pytest.raises(APITimeoutError):
        client.run(CONTEXT, AGENTS, timeout=0.3)
    assert len(server.requests) == 1
    server.faults = [("delay", 1.5)]
    with Client(server.url, timeout=0.3, retries=0) as c:  # the client's default applies to every call
        with pytest.raises(APITimeoutError):
            c.run(CONTEXT, AGENTS)


# ---- streaming ---------------------------------------------------------------------------------

def test_sync_stream_events(server, client):
    events = list(client.stream(CONTEXT, AGENTS, rounds=2))
    assert server.requests[-1][2]["stream"] is True
    assert isinstance(events[-1], RunDone)
    final = events[-1].result
    for r in final.results:
        deltas = "".join(e.text for e in events if isinstance(e, AgentDelta) and e.agent == r.name
                         and e.round == r.round)
        assert deltas == r.text
        assert r.timings.ttft_s is not None and 0 < r.timings.ttft_s <= r.timings.total_s
    dones = [e for e in events if isinstance(e, AgentDone)]
    assert len(dones) == 6 and [e.round for e in events if isinstance(e, RoundDone)] == [0, 1]
    first_done = events.index(dones[0])
    assert all(isinstance(e, AgentDelta) for e in events[:first_done])


def test_async_per_agent_streams(server):
    async def main():
        async with AsyncClient(server.url, retries=0) as c:
            async with c.stream(CONTEXT, AGENTS) as run:
                async def collect(name):
                    return "".join([t async for t in run.agent(name, round=0)])

                texts = await asyncio.gather(*(collect(a.label) for a in AGENTS))
                result = await run.result()
                with pytest.raises(KeyError, match="nobody"):
                    run.agent("nobody")
            return texts, result

    texts, result = asyncio.run(main())
    assert texts == [result[a.label].text for a in AGENTS]
    assert all(t for t in texts)


def test_async_event_iteration_and_run(server):
    async def main():
        async with AsyncClient(server.url) as c:
            async with c.stream_workflow(Workflow.fan_out(*AGENTS[:2]), CONTEXT) as run:
                kinds = [type(e).__name__ async for e in run]
            plain = await c.run(CONTEXT, AGENTS[:2])
            return kinds, await run.result(), plain

    kinds, streamed, plain = asyncio.run(main())
    assert kinds[-1] == "RunDone" and kinds.count("AgentDone") == 2
    assert [r.text for r in streamed.results] == [r.text for r in plain.results]


def test_error_mid_stream_raises_everywhere(server, client):
    server.faults = [("stream_error", 2)]
    with pytest.raises(StreamError, match="decoder died"):
        list(client.stream(CONTEXT, AGENTS))

    async def main():
        async with AsyncClient(server.url) as c:
            async with c.stream(CONTEXT, AGENTS) as run:
                with pytest.raises(StreamError, match="decoder died"):
                    async for _ in run.agent("verify"):
                        pass
                with pytest.raises(StreamError):
                    await run.result()

    server.faults = [("stream_error", 2)]
    asyncio.run(main())


def test_completion_and_ready(client):
    c = client.complete("lookup", "Where does order 7 ship", max_tokens=4)
    assert c.text == agent_text("lookup", "Where does order 7 ship", 0)
    assert c.usage.cached_tokens == c.usage.prompt_tokens - 1
    ready = client.ready()
    assert ready.ready and ready.engines == 4
    chat = client.chat("verify", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Is it late"}])
    assert chat.text == agent_text("verify", "Is it late", 0) and chat.model == "verify"
    with pytest.raises(ModelNotFoundError):
        client.chat("nope", [{"role": "user", "content": "hi"}])


def test_workflows_stream_and_async(server, client):
    wf = Workflow.pipeline(AGENTS[0], AGENTS[1:])
    events = list(client.stream_workflow(wf, CONTEXT))
    final = events[-1].result
    assert [len(r) for r in final.rounds] == [1, 2] and server.requests[-1][2]["stream"] is True

    def tag(context, results):
        return context + " | " + ",".join(r.name for r in results)

    async def main():
        async with AsyncClient(server.url) as c:
            return await c.run_workflow(Workflow(wf.rounds, tag), CONTEXT)

    async def service():
        async with AsyncClient(server.url) as c:
            return (await c.health(), await c.wait_ready(timeout_s=5), await c.chat("lookup", [{"role": "user", "content": "Where"}]),
                    await c.complete("lookup", "Where"))

    healthy, ready, chat, completion = asyncio.run(service())
    assert healthy and ready.ready and chat.text == completion.text == agent_text("lookup", "Where", 0)
    res = asyncio.run(main())
    assert res.final_context == CONTEXT + " | lookup | tools,verify"
    assert [r.text for r in res.results] == [r.text for r in client.run_workflow(Workflow(wf.rounds, tag), CONTEXT).results]


# ---- per-agent OpenAI options ---------------------------------------------------------------

def test_agent_options_are_sent_as_the_apps_fields(server, client):
    from prefillshare.agents import StructuredOutput

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    agent = Agent("lookup", "Find it", sampling=Sampling(max_tokens=8, temperature=0.5, stop=["\n", "."], n=2,
                                                         logprobs=3, seed=1, logit_bias={5: -100.0},
                                                         structured=StructuredOutput.for_schema(schema)))
    client.run(CONTEXT, [agent, {"model": "verify", "instruction": "Check", "stop": "x",
                                 "response_format": {"type": "json_object"}}])
    sent = server.requests[-1][2]["agents"]
    assert sent[0] == {"name": "lookup", "model": "lookup", "instruction": "Find it", "temperature": 0.5,
                       "top_p": 1.0, "max_tokens": 8, "seed": 1, "n": 2, "logprobs": 3, "stop": ["\n", "."],
                       "logit_bias": {"5": -100.0},
                       "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
    assert sent[1]["stop"] == ["x"] and sent[1]["response_format"] == {"type": "json_object"}
    with pytest.raises(WorkflowError, match="sampling.n"):
        Sampling(n=2)  # greedy decoding gives one sequence
    with pytest.raises(WorkflowError, match="seed"):
        Sampling(seed=2 ** 70)
    with pytest.raises(WorkflowError, match="response_format"):
        client.run(CONTEXT, [{"model": "verify", "instruction": "Check", "response_format": {"type": "yaml"}}])
    client.chat("lookup", [{"role": "user", "content": "hi"}], max_tokens=2, stop=["\n"], n=1, logprobs=True)
    assert server.requests[-1][2] == {"model": "lookup", "messages": [{"role": "user", "content": "hi"}],
                                      "temperature": 0.0, "max_tokens": 2, "stop": ["\n"], "n": 1, "logprobs": True}
