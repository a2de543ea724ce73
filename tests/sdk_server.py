"""A small real HTTP server on 127.0.0.1 that answers like the app's documented API.

It exists to provoke what the real app rarely does on demand (503s, dropped connections,
slow answers, an error mid-stream) so the SDK's retry, timeout and error mapping can be
tested; the SDK's behaviour against the real app is tested in tests/keyless_app/test_sdk_e2e.py. Answers are
computed from the request (not canned): each agent's text names its model and instruction,
token counts follow the words sent, and rounds join outputs as the app does.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODELS = {"lookup": "base", "tool_call": "base", "verify": None}  # decoder -> prefill module


def _error(message: str, param: str | None, code: str, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def agent_text(model: str, instruction: str, round_: int) -> str:
    """What the server answers; an instruction starting with FAIL makes that agent fail."""
    if instruction.startswith("FAIL"):
        return ""
    return f"{model} r{round_}: {instruction.split()[0].lower()}"


class AppLikeServer:
    """`faults` is consumed one per request: ("status", code, headers) / ("drop",) / ("delay", s)
    / ("stream_error", after_n_events). `requests` records (method, path, body)."""

    def __init__(self):
        self.faults: list[tuple] = []
        self.requests: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status: int, obj: Any, headers: dict | None = None):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str):
                try:
                    self._answer(method)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def _answer(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = None
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                with outer.lock:
                    outer.requests.append((method, self.path, body))
                    fault = outer.faults.pop(0) if outer.faults else None
                stream_error_after = None
                if fault:
                    if fault[0] == "status":
                        return self._send(fault[1], _error("engine busy", None, "engine_error", "server_error"),
                                          fault[2] if len(fault) > 2 else None)
                    if fault[0] == "drop":
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    if fault[0] == "delay":
                        time.sleep(fault[1])
                    if fault[0] == "stream_error":
                        stream_error_after = fault[1]
                route = (method, self.path)
                if route == ("GET", "/healthz"):
                    return self._send(200, {"status": "ok"})
                if route == ("GET", "/ready"):
                    return self._send(200, {"ready": True, "engines": 1 + len(MODELS)})
                if route == ("GET", "/v1/models"):
                    return self._send(200, {"object": "list", "data": [
                        {"id": m, "object": "model", "owned_by": "prefillshare", "prefill_module": p,
                         "private_prefill_reason": None if p else "no compatible prefill module"}
                        for m, p in MODELS.items()]})
                if route == ("POST", "/v1/completions"):
                    return self._completion(body)
                if route == ("POST", "/v1/chat/completions"):
                    if not isinstance(body, dict) or not body.get("messages"):
                        return self._send(400, _error("messages: Field required", "messages", "invalid_value"))
                    last = body["messages"][-1]["content"]
                    return self._completion({"model": body.get("model"), "prompt": last}, chat=True)
                if route == ("POST", "/v1/agents/run"):
                    return self._run(body, stream_error_after)
                return self._send(404, {"detail": "Not Found"})

            do_GET = lambda self: self._handle("GET")  # noqa: E731
            do_POST = lambda self: self._handle("POST")  # noqa: E731

            def _completion(self, body, chat: bool = False):
                if not isinstance(body, dict):
                    return self._send(400, _error("request body is not valid JSON", None, "invalid_json"))
                if body.get("model") not in MODELS:
                    return self._send(404, _error(f"model {body.get('model')!r} does not exist", "model",
                                                  "model_not_found"))
                text = agent_text(body["model"], body["prompt"], 0)
                n = len(body["prompt"].split())
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                return self._send(200, {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                        "model": body["model"], "choices": [choice],
                                        "usage": {"prompt_tokens": n, "completion_tokens": len(text.split()),
                                                  "total_tokens": n + len(text.split()),
                                                  "prompt_tokens_details": {"cached_tokens": n - 1}}})

            def _run(self, body, stream_error_after):
                if not isinstance(body, dict) or not isinstance(body.get("context"), str):
                    return self._send(400, _error("context: Field required", "context", "invalid_value"))
                if not body["context"].strip():
                    return self._send(400, _error("context is empty", "context", "invalid_value"))
                if isinstance(body.get("rounds"), list):
                    rounds, prefix = body["rounds"], "rounds"
                else:
                    rounds, prefix = [body.get("agents") or []] * int(body.get("rounds") or 1), None
                for r, agents in enumerate(rounds):
                    for i, a in enumerate(agents):
                        if a.get("model") not in MODELS:
                            p = f"rounds[{r}][{i}].model" if prefix else f"agents[{i}].model"
                            return self._send(404, _error(f"model {a.get('model')!r} does not exist; served models: "
                                                          + ", ".join(MODELS), p, "model_not_found"))
                        if a.get("max_tokens", 1) > 64:
                            p = f"rounds[{r}][{i}].max_tokens" if prefix else f"agents[{i}].max_tokens"
                            return self._send(400, _error(f"context + {p} exceeds the context of 64 tokens", p,
                                                          "context_length_exceeded"))
                events, final = _simulate(body, rounds)
                if not body.get("stream"):
                    return self._send(200, {"id": "run-1", "object": "agents.run", **final})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for n, ev in enumerate(events):
                    if stream_error_after is not None and n == stream_error_after:
                        ev = _error("internal error: decoder died", None, "internal", "server_error")
                    self._chunk(f"data: {json.dumps(ev)}\n\n")
                    time.sleep(0.002)
                    if stream_error_after is not None and n == stream_error_after:
                        break
                self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, text: str):
                data = text.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> AppLikeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _simulate(body: dict, rounds: list[list[dict]]) -> tuple[list[dict], dict]:
    """Events and final result the app would produce (shape of deployments/path/orchestrator.py)."""
    context = body["context"]
    events, results = [], []
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "shared_prefix_tokens": 0,
             "prefill_tokens_computed": 0}
    for r, agents in enumerate(rounds):
        shared = len(context.split())
        round_results = []
        for a in agents:
            text = agent_text(a["model"], a["instruction"], r)
            words = text.split(" ") if text else []
            for i, w in enumerate(words):
                events.append({"id": "run-1", "type": "delta", "round": r, "agent": a.get("name") or a["model"],
                               "model": a["model"], "text": w if i == 0 else " " + w})
        for a in agents:
            text = agent_text(a["model"], a["instruction"], r)
            prompt = shared + len(a["instruction"].split())
            cached = shared if MODELS[a["model"]] else 0
            res = {"round": r, "name": a.get("name") or a["model"], "model": a["model"], "text": text,
                   "token_ids": list(range(len(text.split()))), "finish_reason": "length" if text else "error",
                   "error": None if text else "engine_error: decoder replica died",
                   "usage": {"prompt_tokens": prompt, "completion_tokens": len(text.split()), "cached_tokens": cached},
                   "prefill": {"module": MODELS[a["model"]], "replica": "r0"} if MODELS[a["model"]] else None}
            round_results.append(res)
            events.append({"id": "run-1", "type": "agent_done", "round": r, "agent": res["name"],
                           "model": a["model"], "result": res})
            usage["prompt_tokens"] += prompt
            usage["completion_tokens"] += len(text.split())
            usage["cached_tokens"] += cached
        usage["shared_prefix_tokens"] += shared if len(agents) > 1 else 0
        usage["prefill_tokens_computed"] += shared + sum(len(a["instruction"].split()) for a in agents)
        results += round_results
        events.append({"id": "run-1", "type": "round_done", "round": r, "agents": round_results})
        if body.get("join_outputs", True) and r + 1 < len(rounds):
            context = context + "\n" + "\n".join(f"{x['name']}:{x['text'].strip()}" for x in round_results)
    final = {"results": results, "usage": usage, "final_context": context}
    events.append({"id": "run-1", "type": "done", "round": len(rounds) - 1, **final})
    return events, final
