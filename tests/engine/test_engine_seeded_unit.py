"""The draft-probability keeper (vllm_prove/engine/seeded.py) against vLLM's runner interface,
without an engine: which probabilities each verified draft is tested against.

The synchronous path runs for real in the engine tests (test_engine_lossless.py: a seeded request
that waits a step keeps its probabilities). The branch for drafts that are not the ones drafted
(vLLM's asynchronous scheduler verifies a request that missed a step on placeholder drafts) needs
a GPU engine, so it is driven here through the same methods."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_prove.engine.seeded import KeepDraftProbsMixin

VOCAB, K = 6, 2


class _VllmRunner:
    """The slice of vLLM's model runner the mixin reads and calls."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict = {}
        self._draft_probs = self._draft_prob_req_ids = self._draft_token_ids = None

    def _sample(self, logits, spec_decode_metadata):
        return "sampled"

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        return "vllm"  # vLLM's own lookup (one-hot for the whole batch when a row is missing)


class _Runner(KeepDraftProbsMixin, _VllmRunner):
    pass


def _probs(seed: int) -> torch.Tensor:  # [K, VOCAB]
    return torch.rand(K, VOCAB, generator=torch.Generator().manual_seed(seed)).softmax(-1)


def _drafted(runner: _Runner, drafts: dict[str, list[int]]) -> None:
    """A step in which `drafts` were proposed (their probabilities kept one step by vLLM)."""
    ids = list(drafts)
    runner.requests.update(dict.fromkeys(ids))
    runner._draft_prob_req_ids = ids
    runner._draft_token_ids = torch.tensor([drafts[r] for r in ids])  # [num_reqs, K]
    runner._draft_probs = torch.stack([_probs(i) for i in range(len(ids))])  # [num_reqs, K, VOCAB]


def _metadata(verified: dict[str, list[int]]):
    return SimpleNamespace(num_draft_tokens=[len(v) for v in verified.values()],
                           draft_token_ids=torch.tensor([t for v in verified.values() for t in v]))


def _setup():
    """`a` and `b` drafted; the next step schedules only `a`, so `b`'s row is kept."""
    runner = _Runner()
    _drafted(runner, {"a": [1, 2], "b": [3, 4]})
    runner.input_batch.req_ids = ["a"]
    assert runner._sample(None, None) == "sampled"
    # the step after: `c` drafted meanwhile, `b` comes back to be verified
    _drafted(runner, {"c": [5, 0]})
    runner.input_batch.req_ids = ["c", "b"]
    return runner


def test_a_request_that_waited_is_tested_against_its_own_draft_probabilities():
    runner = _setup()
    probs = runner._get_spec_decode_draft_probs(_metadata({"c": [5, 0], "b": [3, 4]}))  # [4, VOCAB]
    assert torch.equal(probs[:2], _probs(0))  # c: this step's row
    assert torch.equal(probs[2:], _probs(1))  # b: its kept row, not a one-hot fallback


def test_placeholder_drafts_are_tested_one_hot_not_against_the_kept_probabilities():
    # vLLM's asynchronous scheduler verifies a request that missed a step on placeholder
    # drafts (token 0): its kept probabilities belong to other tokens and would bias the test
    runner = _setup()
    probs = runner._get_spec_decode_draft_probs(_metadata({"c": [5, 0], "b": [0, 0]}))
    assert torch.equal(probs[:2], _probs(0))
    assert torch.equal(probs[2:], torch.nn.functional.one_hot(torch.tensor([0, 0]), VOCAB).float())
    # a prefix of its own drafts (a shorter verification) still reads the kept row
    probs = runner._get_spec_decode_draft_probs(_metadata({"c": [5], "b": [3]}))
    assert torch.equal(probs[1:], _probs(1)[:1])


def test_a_request_without_probabilities_is_one_hot_alone_the_others_keep_theirs():
    runner = _setup()
    runner.requests["d"] = None
    runner.input_batch.req_ids = ["c", "b", "d"]
    probs = runner._get_spec_decode_draft_probs(_metadata({"c": [5, 0], "b": [3, 4], "d": [2, 2]}))
    assert torch.equal(probs[:4], torch.cat([_probs(0), _probs(1)]))
    assert torch.equal(probs[4:], torch.nn.functional.one_hot(torch.tensor([2, 2]), VOCAB).float())


def test_verified_or_finished_requests_are_forgotten():
    runner = _setup()
    runner._sample(None, None)  # `b` verified in this step
    assert runner._prove_kept_draft_probs == {}
    assert runner._get_spec_decode_draft_probs(_metadata({"c": [5, 0]})) == "vllm"  # nothing kept: vLLM's lookup
