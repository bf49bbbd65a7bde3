"""ProVe-lossless replicas on Ray Serve LLM, as a user runs them: `ray start --head`, then
`vllm-prove serve-ray --replicas 2 --address ...` joining that cluster, the real `openai` client
against it, the replicas' Prometheus metrics from Ray's metrics endpoint, then SIGTERM and
`ray stop` leaving no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from engine_support import PROPOSER, heldout_prompts

from vllm_prove.engine.generate import engine

pytestmark = [pytest.mark.slow, pytest.mark.engine]

NUM_REQUESTS = 64
MAX_TOKENS = 32
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 420  # two engines starting side by side on two cores
MODEL_ID = "zoo-proposer"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "ray"), *args], capture_output=True, text=True,
                          timeout=180)


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _metric(text: str, name: str) -> dict[str, float]:
    """``name``'s samples summed per ``ReplicaId`` label (Ray's Prometheus text format)."""
    per_replica: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'ReplicaId="' in line:
            replica = line.split('ReplicaId="', 1)[1].split('"', 1)[0]
            per_replica[replica] = per_replica.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return per_replica


@pytest.fixture(scope="module")
def ar_tokens():
    """vLLM's plain greedy tokens of the requests (16 in flight), before the cluster starts."""
    from vllm import SamplingParams

    prompts = heldout_prompts()[:NUM_REQUESTS]
    with engine(dict(model=PROPOSER, dtype="float32", enforce_eager=True, seed=0, max_model_len=MAX_MODEL_LEN,
                     max_num_seqs=16)) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return prompts, [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def app(ar_tokens, tmp_path_factory):
    """A one-node Ray cluster (`ray start --head`) and `vllm-prove serve-ray` on it, two lossless
    replicas; torn down by the last test (forcefully here if that test did not run)."""
    gcs_port, metrics_port, http_port = _free_port(), _free_port(), _free_port()
    head = _ray("start", "--head", f"--port={gcs_port}", "--num-cpus=2", f"--metrics-export-port={metrics_port}",
                "--disable-usage-stats", "--include-dashboard=false")
    assert head.returncode == 0, head.stderr[-3000:]
    log_path = tmp_path_factory.mktemp("serve-ray") / "serve-ray.log"
    log = log_path.open("w")
    argv = [sys.executable, "-m", "vllm_prove.cli", "serve-ray", "--method", "prove-lossless", "--replicas", "2",
            "--address", f"127.0.0.1:{gcs_port}", "--port", str(http_port), "--model-id", MODEL_ID,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16"]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    state = {"process": process, "log": log_path, "base": f"http://127.0.0.1:{http_port}/v1",
             "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "raylet": None}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "serving the OpenAI API" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve-ray did not come up: {log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield state
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _ray("stop", "--force")
        log.close()


def test_two_lossless_replicas_answer_64_concurrent_requests_like_plain_greedy(app, ar_tokens):
    from openai import AsyncOpenAI

    prompts, expected = ar_tokens
    client = AsyncOpenAI(base_url=app["base"], api_key="unused", max_retries=0, timeout=300)

    async def ask_all():
        return await asyncio.gather(*[
            client.completions.create(model=MODEL_ID, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"return_token_ids": True})
            for p in prompts], return_exceptions=True)

    answers = asyncio.run(ask_all())
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors[:3]
    got = [a.choices[0].model_extra["token_ids"] for a in answers]
    mismatched = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} differ from plain greedy, first: {mismatched[:5]}"


def test_both_replicas_served_and_report_spec_decode_metrics(app):
    """Ray's Prometheus endpoint, one series per replica (the ``ReplicaId`` label): both replicas
    finished requests, all 64 together, and both ran ProVe's drafts (vLLM's spec-decode counters)."""
    deadline = time.monotonic() + 60  # Ray exports metrics every few seconds
    while True:
        text = urllib.request.urlopen(app["metrics"], timeout=10).read().decode()
        finished = _metric(text, "ray_vllm_request_success_total")
        if sum(finished.values()) >= NUM_REQUESTS or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(finished) == 2 and min(finished.values()) > 0, finished
    assert sum(finished.values()) == NUM_REQUESTS, finished
    drafts = _metric(text, "ray_vllm_spec_decode_num_drafts_total")
    accepted = _metric(text, "ray_vllm_spec_decode_num_accepted_tokens_total")
    assert drafts.keys() == finished.keys() and min(drafts.values()) > 0, drafts
    assert accepted.keys() == finished.keys() and min(accepted.values()) > 0, accepted


def test_sigterm_and_ray_stop_leave_no_process(app):
    """SIGTERM removes the application (serve-ray joined the cluster, so Ray stays up), exit code
    0; `ray stop` then ends the cluster, and no process of it (replicas, their vLLM engine cores,
    Ray's own) is left."""
    process = app["process"]
    raylets = [p for p in psutil.process_iter(["name", "cmdline"]) if "raylet" in (p.info["name"] or "")]
    cluster = {p.pid for p in raylets} | set().union(*(_descendants(p.pid) for p in raylets))
    engines = [pid for pid in cluster if "EngineCore" in " ".join(psutil.Process(pid).cmdline() or [""])]
    assert len(engines) == 2, "one vLLM engine core per replica"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, app["log"].read_text()[-3000:]
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(psutil.pid_exists(pid) for pid in engines), "the application's engines outlived serve-ray"
    assert all(psutil.pid_exists(p.pid) for p in raylets), "serve-ray stopped a cluster it did not start"
    stop = _ray("stop")
    assert stop.returncode == 0, stop.stderr[-2000:]
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in cluster if psutil.pid_exists(pid)]) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive, [psutil.Process(pid).cmdline() for pid in alive if psutil.pid_exists(pid)]
