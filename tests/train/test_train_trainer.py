"""The training loop: checkpoint + resume, and the validation of TrainConfig."""

from __future__ import annotations

import pytest
import torch

from train_tiny import MASK_TOKEN_ID, CountingLanguage, tiny_qwen2
from vllm_prove.config import TrainConfig
from vllm_prove.train.trainer import train

STEPS, INTERRUPT_AT = 10, 4
# attention dropout on, so the global torch RNG (dropout masks) must be resumed too
CFG = TrainConfig(objective="mars", block_size=4, lr=3e-3, warmup_steps=3, steps=STEPS, batch_size=4,
                  seq_len=12, checkpoint_every=INTERRUPT_AT, seed=7)


class _Interrupted(Exception):
    pass


class _DiesAfter:
    """The counting language, killed (as by a pre-emption) at its `calls`+1-th batch."""

    def __init__(self, calls: int):
        self.inner, self.calls = CountingLanguage(CFG.seq_len), calls

    def sample(self, batch_size, gen):
        if self.calls == 0:
            raise _Interrupted
        self.calls -= 1
        return self.inner.sample(batch_size, gen)


def _model(seed: int):
    return tiny_qwen2(seed=seed, attention_dropout=0.2)


def test_train_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Exact equality, not a tolerance: on one machine, in one process with a fixed thread
    count, CPU kernels are deterministic, and the checkpoint holds everything the next step
    reads bit for bit (fp32 weights, AdamW moments and step counts, the batch sampler's and
    the dropout RNG states). Any loss of state (optimizer moments, RNG, the weights themselves,
    the step counter driving the lr schedule) moves the weights by ~lr = 1e-3, far above any
    reasonable tolerance, so exactness costs nothing and hides nothing."""
    reference = _model(seed=0)
    train(reference, CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID)

    first = _model(seed=0)
    with pytest.raises(_Interrupted):
        train(first, _DiesAfter(INTERRUPT_AT + 2), CFG, mask_token_id=MASK_TOKEN_ID, out_dir=tmp_path)
    state = torch.load(tmp_path / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["step"] == INTERRUPT_AT  # the last checkpoint, not the two steps after it

    # a differently initialised model: everything must come from the checkpoint
    resumed = _model(seed=1)
    log = train(resumed, CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID, out_dir=tmp_path,
                resume=True)
    assert log["tokens"] == STEPS * CFG.batch_size * CFG.seq_len  # the whole stage, first run included
    assert len(log["history"]) < STEPS  # this run's own log lines only
    want, got = reference.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs by {(want[name] - got[name]).abs().max()}"
    # and training did move the weights (the comparison is not between two untouched inits)
    assert not torch.equal(want["model.embed_tokens.weight"], _model(seed=0).state_dict()["model.embed_tokens.weight"])


def test_resuming_a_finished_stage_reports_its_run(tmp_path):
    """A build resumed after a stage finished must not report that stage as NaN / 0 s."""
    model = _model(seed=0)
    first = train(model, CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID, out_dir=tmp_path)
    again = train(_model(seed=1), CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID,
                  out_dir=tmp_path, resume=True)
    assert again["loss"] == first["loss"] and again["tokens"] == first["tokens"] == STEPS * CFG.batch_size * CFG.seq_len
    assert again["seconds"] >= first["seconds"] > 0 and again["history"] == []


def test_train_final_checkpoint_is_the_trained_model(tmp_path):
    model = _model(seed=0)
    cfg = CFG.model_copy(update={"checkpoint_every": 1000})
    train(model, CountingLanguage(cfg.seq_len), cfg, mask_token_id=MASK_TOKEN_ID, out_dir=tmp_path)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
    assert saved.config.mask_token_id == MASK_TOKEN_ID
    for name, value in model.state_dict().items():
        assert torch.equal(saved.state_dict()[name], value), name
    assert torch.load(tmp_path / "checkpoint" / "trainer.pt", weights_only=False)["step"] == STEPS


def test_train_mars_without_mask_token_is_refused():
    with pytest.raises(ValueError, match="mask_token_id"):
        train(_model(seed=0), CountingLanguage(CFG.seq_len), CFG)


@pytest.mark.parametrize("field, value, words", [
    ("block_size", 1, "greater than or equal to 2"),
    ("block_size", 65, "less than or equal to 64"),
    ("lr", 0.0, "greater than 0"),
    ("lr", -1e-4, "greater than 0"),
    ("steps", 0, "greater than or equal to 1"),
    ("batch_size", 0, "greater than or equal to 1"),
    ("seq_len", 3, "greater than or equal to 4"),
    ("grad_clip", 0.0, "greater than 0"),
    ("ar_weight", -1.0, "greater than or equal to 0"),
    ("checkpoint_every", 0, "greater than or equal to 1"),
    ("lora_rank", -1, "greater than or equal to 0"),
    ("objective", "beam", "'ar', 'mars' or 'diffusion'"),
])
def test_train_config_rejects_bad_values_naming_the_field(field, value, words):
    with pytest.raises(ValueError) as err:
        TrainConfig(**{field: value})
    message = str(err.value)
    assert field in message and words in message, message


def test_train_config_rejects_warmup_not_shorter_than_training():
    for warmup, steps in [(10, 10), (11, 10)]:
        with pytest.raises(ValueError, match=r"warmup_steps \(\d+\) must be < steps \(10\)"):
            TrainConfig(warmup_steps=warmup, steps=steps)
    assert TrainConfig(warmup_steps=9, steps=10).warmup_steps == 9


def test_train_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="blocksize"):
        TrainConfig(blocksize=8)


def _adapted(seed: int, adapter_seed: int):
    from vllm_prove.train.recipes import attach_adapter

    return attach_adapter(_model(seed=seed), rank=4, mask_id=MASK_TOKEN_ID, seed=adapter_seed)


def test_train_adapter_resume_reproduces_the_uninterrupted_run(tmp_path):
    """The same bit-exact resume through a low-rank adapter: the checkpoint holds the adapter and
    the mask row's delta only, and the frozen base weights never move."""
    reference = _adapted(seed=0, adapter_seed=0)
    train(reference, CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID)
    first = _adapted(seed=0, adapter_seed=0)
    with pytest.raises(_Interrupted):
        train(first, _DiesAfter(INTERRUPT_AT + 2), CFG, mask_token_id=MASK_TOKEN_ID, out_dir=tmp_path)
    assert not (tmp_path / "checkpoint" / "model.safetensors").exists()
    resumed = _adapted(seed=0, adapter_seed=1)  # another adapter init: it must come from the checkpoint
    train(resumed, CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID, out_dir=tmp_path, resume=True)
    want, got = reference.state_dict(), resumed.state_dict()
    trained = [n for n, p in reference.named_parameters() if p.requires_grad]
    assert any("lora_B" in n for n in trained) and any("trainable_tokens" in n for n in trained)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    base = _model(seed=0).state_dict()
    assert torch.equal(reference.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight,
                       base["model.layers.0.mlp.up_proj.weight"])


def test_train_adapter_saves_small_and_merges_to_the_same_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from vllm_prove.train.recipes import save_trained

    class _Tok:  # save_trained saves a tokenizer beside each model
        mask_token, mask_token_id = "<|mask|>", MASK_TOKEN_ID

        def save_pretrained(self, path):
            (tmp_path / "tok-saved").mkdir(exist_ok=True)

    model = _adapted(seed=0, adapter_seed=0)
    train(model, CountingLanguage(CFG.seq_len), CFG, mask_token_id=MASK_TOKEN_ID)
    ids = CountingLanguage(CFG.seq_len).sample(2, torch.Generator().manual_seed(3)).input_ids
    ids[:, -3:] = MASK_TOKEN_ID  # the mask row is part of what was trained
    with torch.no_grad():
        want = model(input_ids=ids).logits
        save_trained(model, _Tok(), tmp_path / "out")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
        again = PeftModel.from_pretrained(_model(seed=0), tmp_path / "out" / "adapter")
        base = _model(seed=0)(input_ids=ids).logits
        # the saved model is exactly the shipped (bf16-rounded) adapter merged into a fresh base
        assert torch.allclose(merged(input_ids=ids).logits, again(input_ids=ids).logits, atol=1e-5)
        shipped_logits = again(input_ids=ids).logits
    # ... which is the trained model up to the bf16 rounding of its adapter, and not the base
    assert (shipped_logits - want).abs().max() < 0.02 < (base - want).abs().max()
    assert not list((tmp_path / "out" / "adapter").glob("model*.safetensors"))
    from safetensors.torch import load_file

    shipped = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert {v.dtype for v in shipped.values()} == {torch.bfloat16}
    assert any("trainable_tokens" in k for k in shipped)
