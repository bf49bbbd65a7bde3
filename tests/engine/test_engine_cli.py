"""`vllm-prove generate --engine vllm` (the reference engine's contract) and the vLLM bench."""

from __future__ import annotations

import json

import pytest
from engine_support import heldout_prompts

from vllm_prove import cli
from vllm_prove.config import Method
from vllm_prove.core.adaptive import COST_TERMS
from vllm_prove.eval import engine_bench

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MAX_TOKENS = 20
NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "source": "heldout"}) + "\n"
                            for p in heldout_prompts()[:NUM_PROMPTS]))
    return path


def _generate(prompt_file, tmp_path, method: str, *extra: str) -> tuple[list[dict], dict]:
    out, summary = tmp_path / f"{method}.jsonl", tmp_path / f"{method}.json"
    rc = cli.main(["generate", "--engine", "vllm", "--method", method, "--prompts", str(prompt_file),
                   "--max-tokens", str(MAX_TOKENS), "--batch-size", "4", "--out", str(out),
                   "--summary", str(summary), *extra])
    assert rc == 0
    return [json.loads(line) for line in out.read_text().splitlines()], json.loads(summary.read_text())


@pytest.fixture(scope="module")
def ar_run(prompt_file, tmp_path_factory):
    return _generate(prompt_file, tmp_path_factory.mktemp("ar"), "ar")


def test_generate_vllm_contract_and_lossless_equals_ar(prompt_file, tmp_path, ar_run):
    ar_rows, ar = ar_run
    ll_rows, ll = _generate(prompt_file, tmp_path, "prove-lossless")
    for rows in (ar_rows, ll_rows):
        assert [r["index"] for r in rows] == list(range(NUM_PROMPTS))
        assert [r["prompt"] for r in rows] == heldout_prompts()[:NUM_PROMPTS]
        for r in rows:
            assert set(r) == {"index", "prompt", "token_ids", "text", "num_tokens", "cycles", "seconds"}
            assert 1 <= r["num_tokens"] == len(r["token_ids"]) <= MAX_TOKENS
            assert 1 <= r["cycles"] <= r["num_tokens"] and r["seconds"] > 0
    assert [r["token_ids"] for r in ll_rows] == [r["token_ids"] for r in ar_rows]
    for summary, method in ((ar, "ar"), (ll, "prove-lossless")):
        assert {"method", "engine", "num_tokens", "seconds", "tokens_per_s", "cycles", "committed_per_cycle",
                "passes"} <= set(summary)
        assert summary["method"] == method and summary["engine"] == "vllm" and summary["batch_size"] == 4
        assert summary["num_tokens"] == sum(r["num_tokens"] for r in ar_rows)
    assert ar["committed_per_cycle"] == 1.0 and ar["cycles"] == ar["num_tokens"]
    # the default: adaptive depth. Its warm-up request ran the start-up probe at one request in
    # flight; 4 in flight is heavier than any load it has speculated at, so the cost model does not
    # predict there (an extrapolation) and the bucket decodes plainly until its budget pays for a
    # first exploration, which a 60-step run never reaches (docs/METHODS.md §9). The lossless path
    # speculating through this CLI: tests/engine/test_engine_real.py (--fixed-depth)
    depth = ll["adaptive_depth"]
    assert ll["adaptive"] is True and depth["steps"] > 0
    four = depth["realized"]["4"]
    assert four["started"] == four["arm"] == "plain" and four["explored_blocks"] == 0, four
    assert "model_ratio" not in four and depth["plain_share"] == 1.0 and "spec_decode" not in ll


def test_generate_vllm_runs_the_sdd_methods(prompt_file, tmp_path, ar_run):
    """Strict SDD inside vLLM is greedy AR; skipping (permissive thresholds) commits tokens the
    target never verified, and SUMMARY.json counts and audits them."""
    ar_rows, _ = ar_run
    rows, sdd = _generate(prompt_file, tmp_path, "sdd")
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in ar_rows]
    assert sdd["gamma"] == 16 and sdd["committed_per_cycle"] > 1.0 and sdd["skipped_rounds"] == 0
    assert 0 < sdd["verifier_calls"] <= sdd["cycles"] and sdd["draft_blocks"] >= sdd["verifier_calls"]
    _, skip = _generate(prompt_file, tmp_path, "sdd-skip", "--k-min", "2", "--eta-b", "0.5", "--eta-c", "0.6")
    assert skip["skipped_rounds"] > 0 and skip["skipped_tokens"] >= 2 * skip["skipped_rounds"]
    assert skip["verifier_calls_per_token"] < sdd["verifier_calls_per_token"]
    # the after-run audit of each skipped round is the reference decoder's shadow audit
    from vllm_prove.config import DecodeConfig
    from vllm_prove.reference.runner import generate as reference_generate

    cfg = DecodeConfig(method=Method.SDD_SKIP, k_min=2, eta_b=0.5, eta_c=0.6, max_tokens=MAX_TOKENS, batch_size=4)
    _, ref = reference_generate(cfg, heldout_prompts()[:NUM_PROMPTS])
    assert (skip["skipped_rounds"], skip["skipped_tokens"]) == (ref["skipped_rounds"], ref["skipped_tokens"])
    assert (skip["strict_token"], skip["full_prefix"]) == (ref["strict_token"], ref["full_prefix"])


def test_generate_vllm_rejects_reference_only_flag(prompt_file, tmp_path, capsys):
    rc = cli.main(["generate", "--engine", "vllm", "--method", "ar", "--prompts", str(prompt_file),
                   "--max-tokens", "4", "--out", str(tmp_path / "o.jsonl"), "--track-ar-match"])
    assert rc == 2 and "--track-ar-match" in capsys.readouterr().err


def test_engine_bench_rows_memory_and_plot(tmp_path):
    """The default bench: one engine at a time, each doing its repeats back to back (the adaptive
    row: the interleaved test below)."""
    runs = [r for r in engine_bench.ENGINE_RUNS if r.label in ("ar", "parallel-draft", "prove theta=0.1",
                                                                "prove-lossless", "sdd")]
    report = engine_bench.run_engine_bench(heldout_prompts()[:6], max_tokens=16, in_flight=(1, 4), runs=runs,
                                           repeats=2, out_dir=tmp_path, log=lambda line: None)
    rows = {(r["label"], r["in_flight"]): r for r in report["rows"]}
    assert set(rows) == {(r.label, n) for r in runs for n in (1, 4)}
    for n in (1, 4):
        sdd = rows["sdd", n]  # strict SDD: greedy AR, its own counters, no cost-model ideal
        assert sdd["same_as_ar"] == 1.0 and sdd["verifier_calls"] > 0 and sdd["ideal_speedup"] is None
        assert rows["prove-lossless", n]["adaptive"] is False and "adaptive_depth" not in rows["prove-lossless", n]
        # two repeats: the median of the per-repeat ratios, inside their spread
        for row in rows.values():
            assert row["repeats"] == 2 and len(row["tokens_per_s_repeats"]) == 2
            lo, hi = row["ratio_spread"]
            assert lo <= row["ratio_to_ar"] <= hi
    for n in (1, 4):
        ar, lossless = rows["ar", n], rows["prove-lossless", n]
        verifier, parallel = rows["prove theta=0.1", n], rows["parallel-draft", n]
        assert ar["ratio_to_ar"] == 1.0 and ar["committed_per_cycle"] == 1.0 and ar["same_as_ar"] == 1.0
        assert lossless["same_as_ar"] == 1.0 and parallel["same_as_ar"] == 1.0  # both verify greedily
        assert lossless["off_argmax"] == ar["off_argmax"]  # same tokens, same teacher-forced check
        assert lossless["committed_per_cycle"] > 1.0 and lossless["ideal_speedup"] > 0
        assert verifier["method"] == Method.PROVE.value and verifier["theta"] == 0.1
        # ProVe-lossless keeps AR's single KV cache; vLLM's parallel drafting adds the draft's
        # layers to every block (a second copy), so the same budget holds fewer tokens.
        assert lossless["kv_capacity_tokens"] == ar["kv_capacity_tokens"] > parallel["kv_capacity_tokens"]
        assert lossless["peak_rss_mb"] > 0
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["rows"] == report["rows"] and set(written["pass_seconds"]) == {"B=8 n=1", "B=8 n=4"}
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interleaved_bench_is_refused_on_a_gpu_before_any_engine_starts(monkeypatch):
    monkeypatch.setattr(engine_bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_bench, "_start", lambda *a: pytest.fail("an engine was started"))
    with pytest.raises(engine_bench.ProveError, match=r"^--interleave: every engine is up at once"):
        engine_bench.run_engine_bench(["x"], in_flight=(1,), runs=engine_bench.ENGINE_RUNS[:1], interleave=True)


def test_interleaved_bench_takes_turns_with_every_engine_up(tmp_path, monkeypatch):
    """`--interleave`: every engine is up at once and they take turns, repeat i from the i-th
    engine on (the default runs each engine's repeats back to back, one engine at a time); the
    A/A control is an engine of its own, checked against AR's run of the same repeat."""
    runs = engine_bench.select_runs(["prove-lossless adaptive", "ar control"])
    turns, memory = [], []
    drive_once = engine_bench._drive_once

    def spy(eng, prompts, params, n):
        turns.append((eng.run.label, n))
        memory.append(engine_bench.engine_peak_rss_mb())  # every engine process of this test
        drive_once(eng, prompts, params, n)

    monkeypatch.setattr(engine_bench, "_drive_once", spy)
    lines = []
    report = engine_bench.run_engine_bench(heldout_prompts()[:6], max_tokens=16, in_flight=(1, 4), runs=runs,
                                           repeats=2, interleave=True, out_dir=tmp_path, log=lines.append)
    ar, lossless, control = "ar", "prove-lossless adaptive", "ar control"
    order = [r.label for r in runs]
    assert order == [ar, lossless, control]  # (AR first: the ratios need its runs)
    assert turns == [(label, n) for n in (1, 4) for label in order + order[1:] + order[:1]]
    rows = {(r["label"], r["in_flight"]): r for r in report["rows"]}
    assert report["interleave"] is True and set(rows) == {(label, n) for label in order for n in (1, 4)}
    for n in (1, 4):
        adaptive = rows[lossless, n]
        assert adaptive["adaptive"] is True
        depth = adaptive["adaptive_depth"]  # this run's decisions only (not the engine's earlier ones)
        assert depth["policy"] == "measured" and 0 < depth["steps"] <= adaptive["passes"]["engine_steps"]
        assert 0.0 <= depth["mean_depth"] <= 8 and set(depth["cost"]) == set(COST_TERMS)
        for label in (lossless, control):
            row = rows[label, n]
            assert row["same_as_ar"] == 1.0 and len(row["tokens_per_s_repeats"]) == 2
            lo, hi = row["ratio_spread"]
            assert lo <= row["ratio_to_ar"] <= hi
        # the control's ratios are its own runs against AR's, repeat by repeat
        ratios = sorted(c / a for c, a in zip(rows[control, n]["tokens_per_s_repeats"], rows[ar, n]["tokens_per_s_repeats"]))
        assert rows[control, n]["ratio_spread"] == pytest.approx(ratios[::len(ratios) - 1], abs=2e-3)
    assert any(line.startswith(lossless) and "%" in line for line in lines)  # the K=0 (plain steps) column
    # each row's memory is its own engine's, not the sum of the engines that were up together
    assert 0 < rows[ar, 1]["peak_rss_mb"] < min(memory[1:])
