"""`vllm-prove eval` end to end on real vLLM engines: a Ray Data actor pool of two engine actors
per method, and the in-process path resuming the Ray run's output folder (the same report from
one local engine as from the pool).

One local Ray cluster for the module; 5 engine starts in all."""

from __future__ import annotations

import json
import os

import pytest

from vllm_prove.eval import runner

pytestmark = [pytest.mark.slow, pytest.mark.engine]

TASKS = ["humaneval", "heldout"]
LIMIT = 3
QUALITY = ("items", "pass@1", "agreement", "ci95", "delta_vs_ar", "delta_ci95", "exact_ar", "loglik", "num_tokens",
           "timed_out")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from vllm_prove.eval import ray_eval

    ray_eval.connect(None, replicas=2)
    yield
    ray.shutdown()


def _config(out, **fields):
    return runner.EvalConfig(**{"tasks": TASKS, "methods": ["ar", "prove-lossless"], "limit": LIMIT, "ray": True,
                                "shard_size": 2, "out": str(out), **fields})


def _records(out, label, task):
    folder = out / "shards" / label / task
    return [json.loads(line) for p in sorted(folder.glob("*.jsonl")) for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_replicas(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-two")
    return out, runner.run_eval(_config(out, replicas=2))


def test_ray_report_lossless_is_ar_exactly_with_speed_for_both(two_replicas):
    out, report = two_replicas
    for name in ("report.json", "report.md", "run.json", "frontier.png", "committed_histogram.png",
                 "position_acceptance.png"):
        assert (out / name).exists(), name
    assert json.loads((out / "report.json").read_text()) == report
    for task in TASKS:
        ar, lossless = (_records(out, label, task) for label in ("ar", "prove-lossless"))
        assert [r["index"] for r in ar] == list(range(LIMIT))
        assert [r["token_ids"] for r in lossless] == [r["token_ids"] for r in ar]  # exactly AR
        assert all(r["token_ids"] for r in ar)
        for label in ("ar", "prove-lossless"):
            entry = report[task][label]
            assert entry["engines"] in (1, 2) and entry["items"] == LIMIT  # (a task's two shards may share an actor)
            assert entry["tokens_per_s"] > 0 and entry["seconds"] > 0
            assert entry["num_tokens"] == sum(len(r["token_ids"]) for r in ar)
        assert report[task]["ar"]["committed_per_cycle"] == 1.0
        assert report[task]["prove-lossless"]["committed_per_cycle"] > 1.5  # the engine's own counters
        assert report[task]["prove-lossless"]["delta_ci95"] == [0.0, 0.0]
    humaneval = report["humaneval"]
    assert humaneval["prove-lossless"]["pass@1"] == humaneval["ar"]["pass@1"]
    heldout = report["heldout"]
    assert heldout["prove-lossless"]["agreement"] == 1.0 and heldout["prove-lossless"]["exact_ar"] == 1.0
    assert heldout["prove-lossless"]["loglik"] == heldout["ar"]["loglik"] < 0
    acceptance = heldout["prove-lossless"]["acceptance_per_position"]
    assert len(acceptance) == 8 and all(1 >= a >= b >= 0 for a, b in zip(acceptance, acceptance[1:]))
    assert sum(heldout["prove-lossless"]["committed_histogram"].values()) == pytest.approx(1.0, abs=1e-3)
    for label in ("ar", "prove-lossless"):  # both engine actors of a method took work
        assert len({r["engine"] for t in TASKS for r in _records(out, label, t)}) == 2, label


def test_resume_in_process_regenerates_only_the_missing_shard(two_replicas):
    """The in-process path on the Ray run's folder: every finished shard is skipped, the one
    deleted shard comes back with the same tokens (same code, same engine settings), and the
    report is the pool's."""
    out, report = two_replicas
    missing = out / "shards" / "ar" / "heldout" / "0001.jsonl"
    before = missing.read_text()
    stamps = {p: p.stat().st_mtime_ns for p in (out / "shards").rglob("*.jsonl") if p != missing}
    missing.unlink()
    lines = []
    again = runner.run_eval(_config(out, ray=False), log=lines.append)
    assert lines[0].startswith("ar: 1 rows in 1 shards")
    assert lines[1] == "prove-lossless: every shard is on disk, nothing to generate"
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # finished shards untouched
    assert [json.loads(x)["token_ids"] for x in missing.read_text().splitlines()] == \
        [json.loads(x)["token_ids"] for x in before.splitlines()]
    assert json.loads(missing.read_text().splitlines()[0])["engine"].startswith(f"local-{os.getpid()}")
    for task in TASKS:
        for label in ("ar", "prove-lossless"):
            assert {k: again[task][label].get(k) for k in QUALITY} == {k: report[task][label].get(k) for k in QUALITY}


@pytest.mark.parametrize("gpu", [False, True])
def test_engine_actors_ask_for_cpus_or_gpus(ray_cluster, gpu):
    """The engine actors' pool (no engine is started): a CPU per engine worker on a CPU cluster, a
    GPU per worker on a GPU cluster (`gpu` is what `_cluster_has_gpus` answers there), one batch
    at a time per actor, the resolver's engine settings."""
    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.engine.generate import method_flags
    from vllm_prove.eval import ray_eval

    cfg = DecodeConfig(method=Method.PROVE_LOSSLESS)
    args = ray_eval.actor_pool_args(cfg, replicas=2, concurrency=4, batch_size=8, gpu=gpu)
    assert args["fn"] is ray_eval.EngineActor and args["batch_size"] == 8
    assert (args.get("num_gpus"), args.get("num_cpus")) == ((1, None) if gpu else (None, 1))
    assert (args["compute"].min_size, args["compute"].max_size) == (2, 2)
    assert args["compute"].max_tasks_in_flight_per_actor == 1
    engine = args["fn_constructor_kwargs"]["engine_kwargs"]
    assert engine["additional_config"] == method_flags(cfg)["additional_config"]  # the resolver's settings
    assert engine["additional_config"]["prove"]["mode"] == "lossless"
    assert engine["max_num_seqs"] == 4 and engine["dtype"] == "float32"
    assert ("VLLM_CPU_KVCACHE_SPACE" in args["runtime_env"]["env_vars"]) is not gpu
    ray_data = __import__("ray").data
    ray_data.from_items([{"x": 1}]).map_batches(**args)  # (Ray Data accepts the arguments; nothing runs lazily)
