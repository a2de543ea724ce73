"""Stock vLLM OpenAI servers as benchmark systems (driven by vLLM's own client only).

  v-lora   what users run today: one ``python -m vllm.entrypoints.openai.api_server`` on the
           base holding the N adapters (``--lora-modules``), prefix caching on; each adapter
           prefills its own prompt (vLLM salts cached blocks per adapter);
  v-one    the bound on sharing: the same server with no adapters, one model answering every
           decoder's name (``--served-model-name agent0 ... agent{N-1}``), so the N requests of a
           context share its prefix-cache blocks and compute it once.

Engine settings are the LoRA group engine's of the app's systems (dtype, KV space, block size,
max_model_len, max_num_seqs, eager, thread binding), so the comparison is engine for engine.
With ``--driver chat`` a server also gets the chat decoders' template (``--chat-template``: its
prompts are the app's system-first prompts, token for token) and answers ``tools`` with
``tool_choice`` auto, as frameworks send them (``--enable-auto-tool-choice``, the ``pythonic``
parser: it needs no special tokens and streams plain text as content).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.systems import Topology, decoder_names

STOCK_SYSTEMS = ("v-lora", "v-one")
SHUTDOWN_S = 20  # the server's own graceful stop (--shutdown-timeout); stop() waits longer before SIGKILL


def server_argv(system: str, base: str, adapters: tuple[str, ...], n: int, topo: Topology, tokenizer: str,
                port: int, chat_template: str | None = None) -> list[str]:
    """The command line of ``system``'s server on 127.0.0.1:``port`` (``chat_template``: --driver chat)."""
    from prefillshare.app.engine import compute_dtype

    if system not in STOCK_SYSTEMS:
        raise ValueError(f"not a stock vLLM system: {system!r}")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--tokenizer", tokenizer,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", compute_dtype.resolve(topo.dtype),
            "--max-model-len", str(topo.max_model_len), "--block-size", str(topo.block_size),
            "--max-num-seqs", str(topo.max_num_seqs * n), "--enforce-eager", "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(int(topo.group_kv_gib(n) * (1 << 30))), "--seed", "0",
            # at 0 (vLLM's default) a stop kills the engine core's worker at once, leaving its shared
            # memory (/dev/shm/psm_*) behind; with time to exit it unlinks them
            "--shutdown-timeout", str(SHUTDOWN_S)]
    if chat_template:
        argv += ["--chat-template", chat_template, "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    names = decoder_names(n)
    if system == "v-one":
        return argv + ["--served-model-name", *names]
    if len(adapters) < n:
        raise ValueError(f"--fanouts: {n} adapters asked, {len(adapters)} prepared")
    return argv + ["--enable-lora", "--max-loras", str(n), "--max-cpu-loras", str(n), "--max-lora-rank",
                   str(topo.lora_rank), "--lora-modules", *[f"{nm}={adapters[i]}" for i, nm in enumerate(names)]]


class StockServer:
    """One stock server process (its own process group), up until :meth:`stop`."""

    def __init__(self, argv: list[str], log_path: Path, threads_bind: str):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads_bind, "HF_HUB_OFFLINE": "1",
               "VLLM_HOST_IP": "127.0.0.1"}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = "http://127.0.0.1:" + argv[argv.index("--port") + 1]

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the vLLM server exited with {self.proc.returncode}: {tail}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"the vLLM server at {self.url} was not healthy after {timeout_s:.0f}s (log: {self.log_path})")

    def stop(self) -> None:
        """SIGTERM to the server, which stops its engine core and worker itself (a signal to the whole
        group killed them mid-teardown, leaving their shared memory in /dev/shm); SIGKILL to the group,
        for whatever is left, after 60 s."""
        if self.proc.poll() is None:
            with _suppress_missing():
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(SHUTDOWN_S + 40)
            except subprocess.TimeoutExpired:
                pass
        with _suppress_missing():
            os.killpg(self.proc.pid, signal.SIGKILL)  # an engine core outliving its server
        self.proc.wait(30)
        self._log.close()


def _suppress_missing():
    import contextlib

    return contextlib.suppress(ProcessLookupError, PermissionError)


def as_prefillshare_counters(metrics: dict) -> dict:
    """vLLM's prefix-cache counters under the names the report reads: prompt tokens computed
    (queried minus hit) and saved (hit), so every system's "prefill tok/session" means the same."""
    from bench.report import metric_sum

    queries = metric_sum(metrics, "vllm:prefix_cache_queries_total")
    hits = metric_sum(metrics, "vllm:prefix_cache_hits_total")
    stage = (("stage", "prefill"),)  # the one engine is the stage that computes prompts
    return {**metrics, ("prefillshare_prefill_tokens_computed_total", stage): queries - hits,
            ("prefillshare_prefill_tokens_saved_total", stage): hits}
