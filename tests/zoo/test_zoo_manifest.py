"""The shipped zoo is what its manifest says, and the build recipe runs end to end."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_prove.zoo import HELDOUT_PROMPTS, ZOO_DIR
from vllm_prove.zoo.corpus import CorpusFile, corpus_hash, load_corpus, split

MAX_ZOO_BYTES = 40 * 2**20


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((ZOO_DIR / "manifest.json").read_text())


def test_manifest_records_the_recipe(manifest):
    assert manifest["command"].startswith("vllm-prove zoo build")
    assert {"python_version", "sha256", "num_train_files", "num_heldout_files"} <= set(manifest["corpus"])
    assert len(manifest["proposer_block_match_rate"]) == manifest["block_size"]
    assert manifest["proposer_block_match_rate"][0] == 1.0  # y_1 is the AR head's own token
    for role in ("proposer", "verifier"):
        m = manifest["models"][role]
        assert m["heldout_loss"] > 0 and m["dtype"] == "bfloat16"


def test_weights_are_small_bf16_qwen2_with_a_mask_token(manifest):
    from safetensors import safe_open

    total = sum(p.stat().st_size for p in ZOO_DIR.rglob("*") if p.is_file())
    assert total <= MAX_ZOO_BYTES
    for role in ("proposer", "verifier", "drafter"):
        cfg = json.loads((ZOO_DIR / role / "config.json").read_text())
        assert cfg["model_type"] == "qwen2" and cfg["mask_token_id"] == manifest["tokenizer"]["mask_token_id"]
        with safe_open(ZOO_DIR / role / "model.safetensors", "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    if manifest["scale"] == "full":
        assert 5e6 <= manifest["models"]["proposer"]["params"] <= 10e6
        assert 0.5e6 <= manifest["models"]["verifier"]["params"] <= 1.5e6


def _skip_unless_the_zoos_corpus(manifest: dict) -> None:
    """The held-out numbers come from the standard library of the Python the zoo was built with;
    another Python's (another patch release) gives other windows and other numbers."""
    if corpus_hash(load_corpus()) != manifest["corpus"]["sha256"]:
        pytest.skip(f"this Python's standard library is not the zoo's corpus (built on Python "
                    f"{manifest['corpus']['python_version']}): its held-out numbers are not recomputable here")


def test_heldout_prompts_come_from_heldout_files(manifest):
    rows = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines()]
    assert len(rows) >= 50
    for row in rows:
        relpath = row["source"].rsplit(":", 1)[0]
        assert CorpusFile(relpath, "").heldout, f"{relpath} is a training file"


def test_split_is_by_file_and_deterministic():
    files = load_corpus()
    train, heldout = split(files)
    assert {f.relpath for f in train}.isdisjoint({f.relpath for f in heldout})
    assert len(heldout) > 10 and len(train) > 5 * len(heldout)
    assert [f.relpath for f in split(load_corpus())[1]] == [f.relpath for f in heldout]


@pytest.mark.slow
def test_smoke_build_runs_the_whole_recipe(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_prove.zoo.build import build_zoo

    out = tmp_path / "models"
    manifest = build_zoo(out, scale="smoke")
    assert json.loads((out / "manifest.json").read_text()) == manifest
    for role in ("proposer", "verifier", "drafter"):
        model = AutoModelForCausalLM.from_pretrained(out / role)
        tok = AutoTokenizer.from_pretrained(out / role)
        assert model.config.mask_token_id == tok.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert model.config.diffusion_drafter == {"kind": "block", "logits_shift": True}
    assert {"strict_accepted", "rate", "gamma", "steps"} <= set(manifest["drafter_match"])
    assert not (tmp_path / "models.work").exists()


def test_loaded_tokenizer_tokenizes_like_the_trained_pipeline():
    """transformers rebuilds Qwen2 tokenizers with its own pre-tokenizer; the zoo's tokenizer.json
    must already be that pipeline, or the models would be served other tokens than they learned."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    _, heldout = split(load_corpus())
    text = "".join(f.text[:5000] for f in heldout[:6]) + "naïve café ｆｕｌｌ\r\n\t  x = 1_000\n"
    for role in ("proposer", "verifier", "drafter"):
        raw = Tokenizer.from_file(str(ZOO_DIR / role / "tokenizer.json"))
        loaded = AutoTokenizer.from_pretrained(ZOO_DIR / role)
        assert loaded(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
        assert loaded.mask_token_id == json.loads((ZOO_DIR / role / "config.json").read_text())["mask_token_id"]


@pytest.mark.slow
def test_manifest_numbers_are_what_the_shipped_weights_give(tmp_path, manifest):
    """`vllm-prove zoo evaluate` on a copy of the zoo whose manifest has every held-out number
    wiped recomputes them from the committed bf16 weights (run in fp32, as the build measured
    them) and gets the shipped manifest back, number for number: the matching prefix at every B,
    the per-position block match, both models' held-out loss and the drafter's match."""
    import shutil

    from vllm_prove.cli import main

    _skip_unless_the_zoos_corpus(manifest)
    zoo = tmp_path / "models"
    shutil.copytree(ZOO_DIR, zoo)
    stale = json.loads((zoo / "manifest.json").read_text())
    stale["proposer_matching_prefix"] = {b: 0.0 for b in stale["proposer_matching_prefix"]}
    stale["proposer_block_match_rate"] = [0.0] * len(stale["proposer_block_match_rate"])
    for role in ("proposer", "verifier"):  # (the drafter's loss is its build's, not a held-out number)
        stale["models"][role]["heldout_loss"] = 0.0
    stale["drafter_match"] |= {"strict_accepted": 0.0, "rate": [0.0] * len(stale["drafter_match"]["rate"])}
    (zoo / "manifest.json").write_text(json.dumps(stale))
    assert main(["zoo", "evaluate", "--out", str(zoo)]) == 0
    assert json.loads((zoo / "manifest.json").read_text()) == json.loads((ZOO_DIR / "manifest.json").read_text())


def test_zoo_evaluate_refuses_another_corpus(tmp_path, capsys):
    """Under a Python whose standard library is not the zoo's corpus, `vllm-prove zoo evaluate`
    would write numbers measured on other held-out windows into the manifest: it stops with the
    reason and leaves the manifest as it was."""
    import shutil

    from vllm_prove.cli import main

    zoo = tmp_path / "models"
    shutil.copytree(ZOO_DIR, zoo)
    other = json.loads((zoo / "manifest.json").read_text())
    other["corpus"] |= {"sha256": "0" * 64, "python_version": "3.0.0"}
    (zoo / "manifest.json").write_text(json.dumps(other))
    assert main(["zoo", "evaluate", "--out", str(zoo)]) == 2
    assert "corpus: this Python's standard library" in capsys.readouterr().err
    assert json.loads((zoo / "manifest.json").read_text()) == other
