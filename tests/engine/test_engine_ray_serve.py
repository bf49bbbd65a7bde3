"""ProVe-lossless replicas on Ray Serve LLM, as a user runs them: `ray start --head`, then
`vllm-prove serve-ray --replicas 2 --address auto` joining that cluster, the real `openai` client
against it, the replicas' Prometheus metrics from Ray's metrics endpoint, then SIGTERM and
`ray stop` leaving no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from engine_support import ENGINE_KWARGS, IN_FLIGHT, assert_equal_or_near_tie, build_cases, free_port

pytestmark = [pytest.mark.slow, pytest.mark.engine]

NUM_REQUESTS = len(build_cases())  # 73, all sent at once
STARTUP_TIMEOUT_S = 420  # two engines starting side by side on two cores
MODEL_ID = "zoo-proposer"


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
def cases_and_greedy(plain_vllm):
    """The engine modules' requests (held-out prompts plus long, shared-prefix and one-token
    ones; stop strings, stop tokens, mixed limits) and vLLM's plain greedy answers to them."""
    return build_cases(), plain_vllm["greedy"]["stops", 1]


@pytest.fixture(scope="module")
def app(cases_and_greedy, tmp_path_factory):
    """A one-node Ray cluster (`ray start --head`) and `vllm-prove serve-ray` on it, two lossless
    replicas, started after the oracle's engine has run (one engine at a time); torn down by the
    last test (forcefully here if that test did not run)."""
    gcs_port, metrics_port, http_port = free_port(), free_port(), free_port()
    temp_dir = tmp_path_factory.mktemp("ray")  # (names this cluster's processes)
    head = _ray("start", "--head", f"--port={gcs_port}", "--num-cpus=2", f"--metrics-export-port={metrics_port}",
                "--disable-usage-stats", "--include-dashboard=false", f"--temp-dir={temp_dir}")
    assert head.returncode == 0, head.stderr[-3000:]
    log_path = tmp_path_factory.mktemp("serve-ray") / "serve-ray.log"
    log = log_path.open("w")
    # the replicas' engines run with the oracle's settings (chunked prefill, prefix caching, KV pressure)
    engine_flags = {k: ENGINE_KWARGS[k] for k in ("block_size", "max_num_batched_tokens", "enable_chunked_prefill",
                                                  "enable_prefix_caching", "num_gpu_blocks_override")}
    argv = [sys.executable, "-m", "vllm_prove.cli", "serve-ray", "--method", "prove-lossless", "--replicas", "2",
            "--address", "auto", "--port", str(http_port), "--model-id", MODEL_ID,
            "--max-model-len", str(ENGINE_KWARGS["max_model_len"]), "--max-num-seqs", str(IN_FLIGHT),
            "--engine-kwargs", json.dumps(engine_flags)]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    state = {"process": process, "log": log_path, "base": f"http://127.0.0.1:{http_port}/v1",
             "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "temp_dir": str(temp_dir)}
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


def test_two_lossless_replicas_answer_every_request_at_once_like_plain_greedy(app, cases_and_greedy, zoo_models):
    from openai import AsyncOpenAI

    cases, expected = cases_and_greedy
    client = AsyncOpenAI(base_url=app["base"], api_key="unused", max_retries=0, timeout=300)

    async def ask_all():
        return await asyncio.gather(*[
            client.completions.create(model=MODEL_ID, prompt=c.prompt, max_tokens=c.max_tokens, temperature=0.0,
                                      stop=list(c.stop) or None,
                                      extra_body={"return_token_ids": True,
                                                  "stop_token_ids": list(c.stop_token_ids) or None})
            for c in cases], return_exceptions=True)

    answers = asyncio.run(ask_all())
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors[:3]
    got = [a.choices[0].model_extra["token_ids"] for a in answers]
    assert_equal_or_near_tie(got, expected, cases, zoo_models.proposer, zoo_models.tokenizer)


def test_both_replicas_served_and_report_spec_decode_metrics(app):
    """Ray's Prometheus endpoint, one series per replica (the ``ReplicaId`` label): both replicas
    finished requests, all of them together, and both ran ProVe's drafts (vLLM's spec-decode counters)."""
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
    raylets = [p for p in psutil.process_iter(["name", "cmdline"])
               if "raylet" in (p.info["name"] or "") and app["temp_dir"] in " ".join(p.info["cmdline"] or [])]
    assert len(raylets) == 1, "this cluster's raylet"
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
