"""HumanEval execution: the bundled reference solutions pass, broken ones fail, the timeout
holds, and nothing runs in the test's own process."""

from __future__ import annotations

import os
import time

import pytest

from vllm_prove.eval import humaneval


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems()


def test_bundled_data_is_all_164_problems(problems):
    assert len(problems) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and problems[-1]["task_id"] == "HumanEval/163"


@pytest.mark.slow
def test_every_reference_solution_passes(problems):
    outcomes = humaneval.check(problems, [p["canonical_solution"] for p in problems])
    assert [o.status for o in outcomes] == ["passed"] * 164
    assert humaneval.pass_at_1(outcomes) == 1.0


def test_broken_solutions_fail(problems):
    broken = ["    return None\n",  # wrong answer
              "    return (\n",  # syntax error
              problems[2]["canonical_solution"].replace("1.0", "2.0"),  # off by a constant
              "    import sys\n    sys.exit(3)\n"]  # exits non-zero before the tests
    outcomes = humaneval.check(problems[:4], broken)
    assert not any(o.passed for o in outcomes)
    assert outcomes[0].status == "failed: AssertionError"
    assert "SyntaxError" in outcomes[1].status
    assert humaneval.pass_at_1(outcomes) == 0.0
    mixed = humaneval.check(problems[:2], [problems[0]["canonical_solution"], "    return None\n"])
    assert humaneval.pass_at_1(mixed) == 0.5


@pytest.mark.slow
def test_timeout_is_enforced_and_kills_the_program(problems, tmp_path):
    marker = tmp_path / "still-running"
    hang = (f"    import os, time\n    if os.fork() == 0:\n        time.sleep(3)\n        open({str(marker)!r}, 'w')\n"
            "    while True:\n        pass\n")
    outcome = humaneval.run_program(humaneval.program(problems[0], hang), timeout=1.0)
    assert outcome == humaneval.Outcome(False, "timed out")
    time.sleep(3.5)
    # the whole process group was killed at the timeout, the forked child too (a harness that
    # waited for the child's 3 s, or killed only the program, leaves the marker)
    assert not marker.exists()


def test_programs_are_isolated_from_the_harness(problems, tmp_path):
    # the child starts in an empty temporary folder with a minimal environment, not ours
    os.environ["PROVE_TEST_SECRET"] = "1"
    try:
        probe = ("    import os, sys\n    assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
                 "    assert 'PROVE_TEST_SECRET' not in os.environ\n    assert sys.flags.isolated\n"
                 + problems[0]["canonical_solution"])
        assert humaneval.run_program(humaneval.program(problems[0], probe)).passed
    finally:
        del os.environ["PROVE_TEST_SECRET"]
