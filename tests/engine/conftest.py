"""Engine tests: the environment must be set before vLLM is first imported (engine_support)."""

import engine_support  # noqa: F401  (the project's own CPU KV-cache default, as the CLI sets it)
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The transformers oracles run in this process beside vLLM's worker (which binds the
    cores): one thread each, or the two oversubscribe the CPUs and the oracles crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def plain_vllm() -> dict:
    """vLLM's own plain decoding (``ENGINE_KWARGS``, no speculation): the oracle every engine
    module compares with, from one engine per session. Greedy token ids of ``build_cases()``
    (``"stops"``) and of ``build_cases(with_stop_strings=False)`` (``"bare"``) at one and
    ``IN_FLIGHT`` requests in flight, the preemptions of the former, and seeded sampled runs."""
    from engine_support import (IN_FLIGHT, build_cases, engine, engine_metric, generate, seeded_runs,
                                seeded_subset, token_ids)

    out = {"greedy": {}, "preemptions": {}}
    with engine() as llm:
        # each set in the order its module's speculative engine runs it, from an empty prefix cache
        for name, cases, order in (("stops", build_cases(), (1, IN_FLIGHT)),
                                   ("bare", build_cases(with_stop_strings=False), (IN_FLIGHT, 1))):
            llm.reset_prefix_cache()
            for in_flight in order:
                before = engine_metric(llm, "vllm:num_preemptions")
                out["greedy"][name, in_flight] = token_ids(generate(llm, cases, in_flight))
                out["preemptions"][name, in_flight] = engine_metric(llm, "vllm:num_preemptions") - before
            if name == "stops":
                out["seeded"] = seeded_runs(llm, seeded_subset(cases))
    return out
