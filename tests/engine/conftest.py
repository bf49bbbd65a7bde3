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
