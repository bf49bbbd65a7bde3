"""Self-distillation targets written by vLLM (`engine/targets.py`) are the greedy continuations
transformers writes, in the same shard format, and the engine is gone after `close()`."""

from __future__ import annotations

import json

import pytest
import torch

from engine_support import PROPOSER
from vllm_prove.engine.targets import VllmContinuations
from vllm_prove.train.data import StreamDataset
from vllm_prove.train.distill import build_targets

pytestmark = pytest.mark.engine


def test_vllm_targets_equal_transformers_greedy_and_the_engine_closes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PROPOSER)
    model = AutoModelForCausalLM.from_pretrained(PROPOSER, dtype=torch.float32).eval()
    import inspect

    stream = StreamDataset(torch.tensor(tok(inspect.getsource(json.decoder))["input_ids"]), 64)
    writer = VllmContinuations(PROPOSER)
    kw = dict(num_contexts=24, max_new_tokens=24, eos_id=tok.eos_token_id, seed=3, shard_size=16)
    by_vllm = build_targets(model, stream, tmp_path / "vllm", continuations=writer, **kw)
    assert writer._llm is not None  # started by the first shard, kept for the second
    writer.close()
    assert writer._llm is None
    by_hf = build_targets(model, stream, tmp_path / "hf", **kw)
    assert [c for c, _ in by_vllm] == [c for c, _ in by_hf]
    same = sum(a == b for (_, a), (_, b) in zip(by_vllm, by_hf))
    assert same == len(by_hf), f"{len(by_hf) - same} of {len(by_hf)} continuations differ"
    assert json.loads((tmp_path / "vllm" / "meta.json").read_text())["engine"] == "VllmContinuations"
    with pytest.raises(ValueError, match="another generator or settings"):  # a resume cannot mix writers
        build_targets(model, stream, tmp_path / "vllm", **kw)
