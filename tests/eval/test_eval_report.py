"""The report from stored records, without an engine: per-task speed from the engines' own
intervals and counters, scores with CIs and paired deltas, the Markdown table and the plots."""

from __future__ import annotations

import json

import pytest

from vllm_prove.eval import report, runner, tasks


def _rec(task, index, tokens, start, end, engine="e1", batch="b1", spec=None, text=""):
    return {"task": task, "index": index, "token_ids": list(range(tokens)), "text": text, "prompt_token_ids": [1],
            "start": start, "end": end, "engine": engine, "batch": batch, "batch_rows": 1, "spec": spec or {}}


def test_speed_uses_engine_intervals_and_splits_shared_batches_by_tokens():
    spec = {"num_drafts": 10, "num_accepted_tokens": 20, "accepted_per_position": [8, 6, 6]}
    records = {
        # engine e1, one batch with both tasks, requests one after the other (1 in flight)
        "a": [_rec("a", 0, 30, 0.0, 1.0, spec=spec)],
        "b": [_rec("b", 0, 10, 1.0, 1.5, spec=spec),
              # engine e2, its own batch, two requests overlapping by 1 s: each is charged half of it
              _rec("b", 1, 20, 10.0, 12.0, engine="e2", batch="b2"), _rec("b", 2, 20, 11.0, 13.0, engine="e2",
                                                                          batch="b2")],
    }
    out = report.speed(records)
    assert out["a"]["seconds"] == pytest.approx(1.0) and out["a"]["num_tokens"] == 30
    assert out["a"]["tokens_per_s"] == pytest.approx(30.0)
    assert out["b"]["seconds"] == pytest.approx(0.5 + 3.0)  # e2 was busy 3 s, not 4
    assert out["b"]["tokens_per_s"] == pytest.approx(50 / 3.5, abs=0.01)
    assert out["b"]["engines"] == 2 and out["a"]["engines"] == 1
    # the shared batch's counters go 3/4 to a (30 of its 40 tokens): the ratios are the batch's
    assert out["a"]["committed_per_cycle"] == pytest.approx(1 + 20 / 10)
    assert out["a"]["acceptance_per_position"] == [0.8, 0.6, 0.6]
    # committed = 1 + accepted: 2 of 10 cycles accepted none, 2 accepted one, 0 two, 6 three
    assert out["a"]["committed_histogram"] == {"1": 0.2, "2": 0.2, "3": 0.0, "4": 0.6}
    plain = report.speed({"c": [_rec("c", 0, 5, 0.0, 1.0)]})["c"]  # AR: no drafts
    assert plain["committed_per_cycle"] == 1.0 and plain["committed_histogram"] == {}


def test_report_scores_cis_deltas_markdown_and_plots(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tasks.load_task(str(path))
    runs = runner.parse_methods(["ar", "prove:theta=0.05"], {}, [1])
    ar_texts = ["0", "1", "2", "3"]  # all right
    prove_texts = ["0", "1", "x", "\\boxed{3}"]  # one wrong
    records = {
        "ar": {"arith": [_rec("arith", i, 4, i, i + 1.0, text=t) for i, t in enumerate(ar_texts)]},
        "prove:theta=0.05": {"arith": [_rec("arith", i, 4, i, i + 0.5, engine="e2", text=t,
                                            spec={"num_drafts": 2, "num_accepted_tokens": 2,
                                                  "accepted_per_position": [2]})
                                       for i, t in enumerate(prove_texts)]},
    }
    rep = report.build_report([task], runs, records)
    ar, prove = rep["arith"]["ar"], rep["arith"]["prove:theta=0.05"]
    assert ar["accuracy"] == 1.0 and ar["ci95"] == [1.0, 1.0] and "delta_vs_ar" not in ar
    assert prove["accuracy"] == 0.75 and prove["delta_vs_ar"] == -0.25
    assert prove["delta_ci95"][0] == -0.75 and prove["delta_ci95"][1] == 0.0
    assert prove["speedup_vs_ar"] == pytest.approx(2.0) and prove["committed_per_cycle"] == 2.0
    runs_meta = runner.parse_methods(["ar", "prove:theta=0.05"], {}, [1])
    report.write(rep, tmp_path / "out", runs_meta, {"tasks": ["arith"]})
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| prove:theta=0.05 | 0.750 | " in md and "-0.250" in md
    for name in ("frontier.png", "committed_histogram.png", "position_acceptance.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "out" / "concurrency.png").exists()  # one concurrency: no sweep plot


def test_concurrency_sweep_plot(tmp_path):
    entry = {"concurrency": 1, "tokens_per_s": 1.0, "speedup_vs_ar": 1.0, "committed_histogram": {},
             "acceptance_per_position": [], "agreement": 1.0, "ci95": [1.0, 1.0]}
    rep = {"t": {f"{m}@c{c}": entry | {"concurrency": c, "speedup_vs_ar": s}
                 for m, s in (("ar", 1.0), ("prove-lossless", 1.5)) for c in (1, 4)}}
    report.plot(rep, tmp_path)
    assert (tmp_path / "concurrency.png").read_bytes()[:4] == b"\x89PNG"
