"""The engine-free arithmetic of `vllm-prove eval`: bootstrap CIs, answer normalization (SDD
paper appendix A.5), the engines' busy time and its split among requests."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_prove.eval import scoring


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_items():
    rng = np.random.default_rng(1)
    small = rng.integers(0, 2, 20).astype(float)
    large = rng.integers(0, 2, 2000).astype(float)
    lo, hi = scoring.bootstrap_ci(small)
    assert lo <= small.mean() <= hi
    lo2, hi2 = scoring.bootstrap_ci(large)
    assert hi2 - lo2 < (hi - lo) / 4  # ~ 1 / sqrt(n)
    assert scoring.bootstrap_ci([1.0] * 5) == (1.0, 1.0)  # no variance, no width
    assert scoring.bootstrap_ci(small, seed=3) == scoring.bootstrap_ci(small, seed=3)  # seeded


def test_paired_bootstrap_is_zero_width_for_identical_methods_and_pairs_items():
    a = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert scoring.paired_bootstrap_ci(a, a) == (0.0, 0.0)  # lossless == AR: delta exactly 0
    # b = a + 1 on every item: paired deltas are all 1, so the interval is exactly [1, 1];
    # an unpaired bootstrap of the two means would be wide
    b = [x + 1 for x in a]
    assert scoring.paired_bootstrap_ci(b, a) == (1.0, 1.0)
    # one item better out of 100: the interval contains the observed delta 0.01 and 0
    base = [0.0] * 100
    lo, hi = scoring.paired_bootstrap_ci([1.0] + base[1:], base)
    assert lo == 0.0 and 0.01 <= hi <= 0.05
    with pytest.raises(ValueError, match="same items"):
        scoring.paired_bootstrap_ci([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="non-empty"):
        scoring.bootstrap_ci([])


def test_paired_bootstrap_coverage_is_about_95_percent():
    rng = np.random.default_rng(0)
    hits = 0
    for trial in range(100):  # two correlated Bernoulli scores whose true delta is 0
        a = (rng.random(200) < 0.5).astype(float)
        b = np.where(rng.random(200) < 0.2, 1.0 - a, a)  # flips some items
        true = 0.0  # symmetric flips: E[b - a] = 0
        lo, hi = scoring.paired_bootstrap_ci(b, a, resamples=2000, seed=trial)
        hits += lo <= true <= hi
    assert 88 <= hits <= 100


@pytest.mark.parametrize("completion, answer", [
    ("so the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{x^{2}+1}", "x^{2}+1"),
    ("The answer is $1,000.", "1000"),
    ("She pays $18.00 in total", "18"),
    ("it grows by 25\\%", "25"),
    ("\\boxed{\\text{(B)}}", "(B)"),
    ("x = -0.50", "-.5"),
    ("#### 72", "72"),
    ("\\boxed{ 3 \\, \\text{cm} }", "3cm"),
])
def test_answer_match_right(completion, answer):
    assert scoring.answer_correct(completion, answer)


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{3}", "4"),
    ("the answer is 12 and then 13", "12"),  # the final number counts
    ("no answer here", "5"),
    ("\\boxed{x+1", "x+1"),  # unbalanced box: no boxed answer, no number either
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),  # no symbolic equivalence (A.5)
    ("1.5", "15"),
])
def test_answer_match_wrong(completion, answer):
    assert not scoring.answer_correct(completion, answer)


def test_extraction_and_normalization_details():
    assert scoring.last_boxed("a \\boxed{1} b \\boxed{\\{2\\}} c") == "\\{2\\}"
    assert scoring.last_boxed("\\fbox{7}") == "7"
    assert scoring.extract_answer("costs -3.5 or +4") == "+4"
    assert scoring.normalize_answer("+4") == "4"
    assert scoring.normalize_answer("0.0") == "0"
    assert scoring.normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert scoring.normalize_answer("90^\\circ") == "90"


def test_busy_seconds_is_the_union_of_intervals():
    assert scoring.busy_seconds([]) == 0.0
    assert scoring.busy_seconds([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert scoring.busy_seconds([(0, 10), (2, 3)]) == pytest.approx(10.0)


def test_attributed_seconds_split_the_busy_time_among_requests_in_flight():
    # alone: the whole interval; two overlapping for 1 s: each is charged 0.5 s of it
    assert scoring.attributed_seconds([(0.0, 2.0)]) == [pytest.approx(2.0)]
    shares = scoring.attributed_seconds([(0.0, 2.0), (1.0, 3.0)])
    assert shares == [pytest.approx(1.5), pytest.approx(1.5)]
    intervals = [(0.0, 4.0), (1.0, 2.0), (1.5, 5.0), (7.0, 8.0)]
    shares = scoring.attributed_seconds(intervals)
    assert sum(shares) == pytest.approx(scoring.busy_seconds(intervals))
    assert shares[3] == pytest.approx(1.0)


def test_scoring_is_engine_free():
    """The arithmetic imports with vLLM, Ray and lm-eval absent (house rule 1)."""
    import subprocess
    import sys

    code = ("import sys\nfor name in ('vllm', 'ray', 'lm_eval', 'torch'):\n    sys.modules[name] = None\n"
            "import vllm_prove.eval.scoring")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
