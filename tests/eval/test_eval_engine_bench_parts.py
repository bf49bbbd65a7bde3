"""The vLLM bench's measurements that need no engine: shares, the teacher-forced argmax check,
pass costs and cycle costs, the table row and the plot."""

from __future__ import annotations

import pytest
import torch

from vllm_prove.config import Method
from vllm_prove.eval import bench, engine_bench
from vllm_prove.reference.runner import RequestResult


def test_same_as_reference_share_counts_common_prefixes():
    reference = [[1, 2, 3, 4], [5, 6], [7]]
    assert engine_bench.same_as_reference_share(reference, reference) == 1.0
    # 2 of 4 (diverges at index 2), 2 of 3 (longer than the reference), 0 of 1
    assert engine_bench.same_as_reference_share([[1, 2, 9, 4], [5, 6, 8], [0]], reference) == pytest.approx(4 / 8)


def test_off_argmax_share_is_zero_for_greedy_and_counts_each_departure(zoo_models):
    model = zoo_models.proposer
    prompt = zoo_models.tokenizer("def main():\n", add_special_tokens=False)["input_ids"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):  # greedy continuation, one token at a time
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = RequestResult(0, "", token_ids=ids[len(prompt):], prompt_token_ids=prompt)
    assert engine_bench.off_argmax_share(model, [greedy]) == 0.0
    wrong = list(greedy.token_ids)
    wrong[3] = (wrong[3] + 1) % model.config.vocab_size  # position 3 leaves the argmax
    share = engine_bench.off_argmax_share(model, [greedy, RequestResult(1, "", token_ids=wrong, prompt_token_ids=prompt)])
    assert share >= 1 / 20  # at least the flipped token (later ones follow a new prefix)
    assert engine_bench.off_argmax_share(model, []) == 0.0


def test_cycle_costs_from_measured_passes():
    costs = {"rows": 1, "ar": 2.0, "window": 3.0, "verify": 3.0, "verifier_block": 1.0, "verifier": 0.5,
             "verify_sd": {3: 2.5, 5: 3.0}}
    assert bench.cycle_cost(Method.AR, 3, costs) == 1.0
    assert bench.cycle_cost(Method.MARS, 3, costs) == 1.5
    assert bench.cycle_cost(Method.PROVE, 3, costs) == pytest.approx(1.5 + 0.5)  # window + rho
    assert bench.cycle_cost(Method.PROVE_LOSSLESS, 3, costs) == pytest.approx(3.0)  # window + verify
    assert bench.cycle_cost(Method.SD, 3, costs) == pytest.approx(3 * 0.25 + 1.25)  # k drafts + verify


def test_pass_costs_measure_every_pass(zoo_models):
    costs = bench.pass_costs(zoo_models.proposer, zoo_models.verifier, block=4, rows=2, ks=(3,), context_len=16)
    assert costs["rows"] == 2 and set(costs["verify_sd"]) == {3}
    assert all(costs[k] > 0 for k in ("ar", "window", "verify", "verifier_block", "verifier"))


def test_format_row_and_plot(tmp_path):
    rows = [{"label": "ar", "in_flight": n, "tokens_per_s": 100.0 * n, "ratio_to_ar": 1.0, "committed_per_cycle": 1.0,
             "same_as_ar": 1.0, "off_argmax": 0.0, "peak_rss_mb": 900.0, "kv_capacity_tokens": 1000,
             "ideal_speedup": 1.0, "efficiency": 1.0, "ms_per_step": 5.0} for n in (1, 4)]
    rows.append(rows[0] | {"label": "prove-lossless", "ratio_to_ar": None, "efficiency": None, "same_as_ar": None})
    assert engine_bench.format_row(rows[0]).split()[:3] == ["ar", "1", "100.0"]
    assert engine_bench.format_row(rows[-1]).count("-") >= 3  # missing values print as '-'
    engine_bench.plot(rows, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_refuses_zero_repeats_before_any_engine_starts():
    from vllm_prove.errors import ProveError

    with pytest.raises(ProveError, match=r"--repeats: at least 1, got 0"):
        engine_bench.run_engine_bench(["def f():"], repeats=0)


def test_select_runs_keeps_ar_first_and_the_control_only_by_name():
    from vllm_prove.errors import ProveError

    every = [r.label for r in engine_bench.select_runs(None)]
    assert every[0] == "ar" and "ar control" not in every and "prove-lossless adaptive" in every
    chosen = [r.label for r in engine_bench.select_runs(["ar control", "sd k=5"])]
    assert chosen == ["ar", "sd k=5", "ar control"]
    with pytest.raises(ProveError, match=r"--methods: unknown \['ar twin'\]; choose from \[.*'ar control'"):
        engine_bench.select_runs(["ar twin"])


def test_select_runs_leaves_out_the_rows_whose_model_a_preset_lacks():
    """A tier without a verifier or a diffusion drafter (SmolLM2's today): its default rows are
    the proposer's own (AR, MARS, ProVe-lossless, parallel drafting), and a row that needs the
    missing model is refused by name, before any engine starts."""
    from vllm_prove.errors import ProveError

    missing = {"verifier": "the smollm2 tier has no verifier yet", "drafter": "the smollm2 tier has no drafter yet"}
    rows = engine_bench.select_runs(None, [16], missing)
    assert [r.label for r in rows] == ["ar", "parallel-draft", "mars tau=0.95", "prove-lossless",
                                       "prove-lossless adaptive", "prove-lossless B=16"]
    assert {r.label: r.needs() for r in engine_bench.select_runs(None)}["sd k=5 adaptive"] == "verifier"
    with pytest.raises(ProveError, match=r"\['prove theta=0.1', 'sdd'\] need a model this preset has not: "
                                         r"the smollm2 tier has no drafter yet; the smollm2 tier has no verifier"):
        engine_bench.select_runs(["prove-lossless", "prove theta=0.1", "sdd"], None, missing)


def test_pass_costs_without_a_verifier_measure_the_proposers_passes(zoo_models):
    costs = bench.pass_costs(zoo_models.proposer, None, block=4, rows=1, ks=(3,), context_len=16)
    assert costs["verifier"] is None and costs["verifier_block"] is None
    assert costs["window"] > 0 and costs["verify_sd"][3] > 0
