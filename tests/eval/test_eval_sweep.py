"""`vllm-prove sweep sdd`: the grids, the frontier and the report (docs/METHODS.md §7)."""

from __future__ import annotations

import json

import pytest

from vllm_prove.cli import main
from vllm_prove.eval.sweep import GRIDS, K_MIN_SWEEP, pareto


def test_grids_are_the_papers():
    assert len(GRIDS["raw"]) == 2 * 7 + 4 and len(GRIDS["marginal"]) == 7 and len(GRIDS["conditional"]) == 8
    assert [s["top_k"] for s in GRIDS["topk"]] == [2, 3, 5] and len(GRIDS["lenience"]) == 8
    assert all(s["eta_b"] == s["eta_c"] for s in GRIDS["marginal"])  # one threshold eta_m
    assert K_MIN_SWEEP == (0, 3, 6, 12, 24)


def test_pareto_keeps_only_undominated_points():
    pts = [(1.0, 1.0), (0.8, 0.99), (0.9, 0.95), (0.6, 0.90), (0.7, 0.80)]
    assert pareto(pts, minimize_x=True) == [(0.6, 0.90), (0.8, 0.99), (1.0, 1.0)]
    assert pareto([(0.9, 10.0), (1.0, 9.0), (0.95, 11.0)], minimize_x=False) == [(1.0, 9.0), (0.95, 11.0)]


@pytest.mark.slow
def test_sweep_writes_report_and_plots(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main(["sweep", "sdd", "--num-prompts", "6", "--num-train-prompts", "10", "--max-tokens", "24",
               "--batch-size", "6", "--families", "raw", "marginal", "--quick", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "sweep.json").read_text())
    assert report["strict"]["quality"] == 1.0  # strict SDD is greedy AR
    families = [r["family"] for r in report["runs"]]
    assert families.count("raw") == len(GRIDS["raw"][::3]) and families.count("k_min") == len(K_MIN_SWEEP)
    assert families.count("marginal") == len(GRIDS["marginal"][::3])
    for run in report["runs"]:
        assert 0.0 <= run["quality"] <= 1.0 and run["relative_verifier_calls"] > 0
    assert {"marginal", "conditional"} <= set(report["survival"])
    assert (out / "survival" / "marginal.pt").exists()
    assert set(report["permutation"]) == {"0.9/0.93", "0.7/0.7"}
    assert (out / "frontier_calls.png").stat().st_size > 0 and (out / "frontier_speed.png").stat().st_size > 0
    assert "k_min" in capsys.readouterr().out
