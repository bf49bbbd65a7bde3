"""The draft model's catch-up bookkeeping under the adaptive depth (vllm_prove/engine/proposers.py,
``CatchUpDraftModelProposer.note_step``) against vLLM's scheduler-output and runner interfaces,
without an engine: which positions a request must catch up before its draft model drafts.

The engine test (test_engine_lossless.py, random schedules in mode ``sd``) checks that the drafts
after a catch-up, and those of requests that reused cached draft KV, are the draft model's own;
here each rule is driven on its own: a prefix-cache hit reuses the draft KV of blocks written by
drafting steps and catches up from the first block a plain step left without it, whether the
request that wrote it has finished (reported in a step of its own, as a run's last requests
are) or still lags."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_prove.engine.adaptive import PlainStepRunnerMixin
from vllm_prove.engine.proposers import CatchUpDraftModelProposer

BLOCK = 4  # tokens per KV block


def _proposer() -> CatchUpDraftModelProposer:
    proposer = CatchUpDraftModelProposer.__new__(CatchUpDraftModelProposer)  # (no model: bookkeeping only)
    proposer.lag, proposer.stale, proposer._catch_up = {}, set(), []
    proposer.last_caught_up = proposer.last_reused = proposer._reused = frozenset()
    spec = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK))
    proposer._runner = SimpleNamespace(requests={}, kv_cache_config=SimpleNamespace(kv_cache_groups=[spec]))
    return proposer


def _step(proposer, new=(), cached=(), finished=(), draft: int = 5) -> None:
    """One engine step as the runner sees it: ``new`` (request, computed tokens, block ids),
    ``cached`` (request, computed tokens, new block ids or None), requests ``finished`` since the
    last step, and the step's draft depth. The proposer is told first, then the runner's record of
    each request's blocks is updated (vLLM's ``_update_states``)."""
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(list(b),)) for r, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached],
                                              new_block_ids=[None if b is None else (list(b),) for _, _, b in cached],
                                              resumed_req_ids=set()),
        finished_req_ids=set(finished), num_spec_tokens_to_schedule=draft,
        total_num_scheduled_tokens=len(new) + len(cached))
    proposer.note_step(output)
    requests = proposer._runner.requests
    for req_id in finished:
        requests.pop(req_id, None)
    for req_id, _, blocks in new:
        requests[req_id] = SimpleNamespace(block_ids=(list(blocks),))
    for req_id, _, blocks in cached:
        if blocks is not None:
            requests[req_id].block_ids[0].extend(blocks)


def test_a_hit_on_blocks_written_by_drafting_steps_reuses_their_draft_kv():
    proposer = _proposer()
    _step(proposer, new=[("a", 0, [1, 2])])  # a's 8-token prompt, in a drafting step
    _step(proposer, cached=[("a", 8, None)])
    _step(proposer, finished=["a"], draft=0)  # a run's last request, reported in a step of its own
    _step(proposer, new=[("b", 8, [1, 2, 3])])  # b's prompt hits a's two blocks
    assert proposer._catch_up == [] and proposer._reused == {"b"} and not proposer.stale


def test_a_hit_on_blocks_a_finished_request_filled_in_plain_steps_catches_up_from_the_first():
    proposer = _proposer()
    _step(proposer, new=[("a", 0, [1, 2])])  # drafting: blocks 1-2 hold draft KV
    _step(proposer, cached=[("a", 8, [3])], draft=0)  # plain: a lags from 8 (block 3)
    _step(proposer, cached=[("a", 9, None)], draft=0)
    assert proposer.lag == {"a": 8}
    _step(proposer, finished=["a"], draft=0)  # reported in an empty step
    assert proposer.stale == {3} and not proposer.lag
    _step(proposer, new=[("b", 12, [1, 2, 3, 4])])  # hits blocks 1-3
    assert proposer._catch_up == [("b", 8, 12)] and proposer._reused == frozenset()
    assert not proposer.stale  # b's catch-up rewrites block 3


def test_a_hit_on_a_lagging_requests_blocks_catches_up_from_its_lag():
    proposer = _proposer()
    _step(proposer, new=[("a", 0, [1, 2])])
    _step(proposer, cached=[("a", 8, [3])], draft=0)  # a lags from 8
    _step(proposer, cached=[("a", 9, None)], new=[("b", 12, [1, 2, 3, 5])], draft=0)  # b hits 1-3 while a lags
    assert proposer.lag == {"a": 8, "b": 8}
    _step(proposer, cached=[("a", 10, None), ("b", 12, None)])  # the next drafting step catches both up
    assert sorted(proposer._catch_up) == [("a", 8, 10), ("b", 8, 12)] and not proposer.lag


class _VllmRunner:
    def execute_model(self, scheduler_output, *args, **kwargs):
        return "ran"


class _Runner(PlainStepRunnerMixin, _VllmRunner):
    def __init__(self) -> None:
        self.drafter = SimpleNamespace(seen=[])
        self.drafter.note_step = self.drafter.seen.append
        self.model_config = SimpleNamespace(is_hybrid=False)


def test_the_runner_tells_the_drafter_of_a_step_that_only_reports_finished_requests():
    runner = _Runner()
    empty = SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids={"a"}, num_spec_tokens_to_schedule=0,
                            scheduled_spec_decode_tokens={})
    idle = SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids=set(), num_spec_tokens_to_schedule=0,
                           scheduled_spec_decode_tokens={})
    assert runner.execute_model(empty) == "ran" and runner.execute_model(idle) == "ran"
    assert runner.drafter.seen == [empty]
