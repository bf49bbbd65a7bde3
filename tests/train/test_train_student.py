"""A student of a base checkpoint (train/student.py): its embedding the base's, projected; what
ships is the rest and the projection, and the rebuilt folder is the trained model bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from vllm_prove.errors import ProveError
from vllm_prove.train import student
from vllm_prove.train.recipes import train_diffusion
from vllm_prove.zoo import ZOO_DIR

BASE = ZOO_DIR / "proposer"  # any HF checkpoint with a tokenizer (the zoo's: Qwen2, 256 wide)
SHAPE = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64}


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "init"
    return out, student.build_student(BASE, out, mask_token="<|mask|>", **SHAPE)


def test_the_embedding_is_the_base_projected_onto_its_principal_directions(built):
    out, info = built
    model, base = _load(out), _load(BASE)
    p = load_file(out / student.PROJECTION)["projection"]  # [256, 32]
    assert p.shape == (256, 32)
    torch.testing.assert_close(p.T @ p, torch.eye(32), atol=1e-5, rtol=0)  # orthonormal directions
    assert (p.gather(0, p.abs().argmax(0, keepdim=True)) > 0).all()  # each sign fixed
    e_base = base.get_input_embeddings().weight.detach().float()
    assert torch.equal(model.get_input_embeddings().weight, e_base @ p)
    # the leading directions keep more of the base's variance than any other 32
    centred = e_base - e_base.mean(0)
    random_basis = torch.linalg.qr(torch.randn(256, 32, generator=torch.Generator().manual_seed(0)))[0]
    assert info["embedding_variance_kept"] > float((centred @ random_basis).pow(2).sum() / centred.pow(2).sum())
    assert model.config.mask_token_id == 1 and model.config.hidden_size == 32 and model.config.tie_word_embeddings
    assert info["num_parameters"] == sum(t.numel() for t in model.parameters())


def test_a_mask_token_outside_the_vocabulary_is_refused(tmp_path):
    with pytest.raises(ProveError, match="mask_token: '<nope>' is not a token"):
        student.build_student(BASE, tmp_path / "s", mask_token="<nope>", **SHAPE)
    with pytest.raises(ProveError, match=r"hidden: must be in \[1, 256\]"):
        student.projection(torch.randn(10, 256), 300)


def test_trained_student_ships_without_its_embedding_and_rebuilds_bit_for_bit(built, tmp_path):
    init, _ = built
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    out = tmp_path / "trained"
    result = train_diffusion(model=str(init), data=str(text), out=str(out), steps=3, warmup_steps=1, batch_size=2,
                             seq_len=32, block_size=4, checkpoint_every=100, lr=1e-2)
    trained = _load(out)
    assert torch.equal(trained.get_input_embeddings().weight, _load(init).get_input_embeddings().weight)  # frozen
    shipped = load_file(out / "artefact" / student.WEIGHTS)
    assert not any("embed" in name or "lm_head" in name for name in shipped)
    assert all(t.dtype == torch.bfloat16 for t in shipped.values())
    assert result["artefact"]["shipped_parameters"] == sum(t.numel() for t in shipped.values())
    layer = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(shipped[layer].float(), _load(init).state_dict()[layer])  # it did train
    count = student.rebuild_student(out / "artefact", BASE, tmp_path / "rebuilt")
    rebuilt = _load(tmp_path / "rebuilt")
    assert count == sum(t.numel() for t in trained.parameters())
    assert rebuilt.config.diffusion_drafter == trained.config.diffusion_drafter
    for (name, a), (_, b) in zip(trained.state_dict().items(), rebuilt.state_dict().items()):
        assert torch.equal(a, b), name


def test_rebuild_refuses_what_is_no_student_artefact(tmp_path):
    with pytest.raises(ProveError, match="not a student artefact"):
        student.rebuild_student(BASE, BASE, tmp_path / "x")
