"""Bad settings fail at once with a message naming the field and the allowed range."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from vllm_prove.config import DecodeConfig, TrainConfig, load_preset


@pytest.mark.parametrize("field,value,phrase", [
    ("theta", 0.0, "greater than 0"),
    ("theta", 1.5, "less than or equal to 1"),
    ("tau", -0.1, "greater than 0"),
    ("block_size", 1, "greater than or equal to 2"),
    ("batch_size", 0, "greater than or equal to 1"),
    ("max_tokens", 0, "greater than or equal to 1"),
    ("k", 0, "greater than or equal to 1"),
    ("method", "beam", "'ar', 'sd', 'mars', 'prove', 'prove-lossless', 'sdd', 'sdd-lenience', 'sdd-topk' or 'sdd-skip'"),
    ("gamma", 1, "greater than or equal to 2"),
    ("lenience", 0.0, "greater than 0"),
    ("eta_b", 1.5, "less than or equal to 1"),
    ("s_max", 0, "greater than or equal to 1"),
    ("k_min", -1, "greater than or equal to 0"),
    ("signal", "vibes", "'raw', 'marginal' or 'conditional'"),
    ("gate", "sum", "'product', 'verifier' or 'proposer'"),
    ("dtype", "float16", "'float32' or 'bfloat16'"),
    ("mask_token_id", -1, "greater than or equal to 0"),
])
def test_decode_config_rejects(field, value, phrase):
    with pytest.raises(ValidationError) as err:
        DecodeConfig(**{field: value})
    text = str(err.value)
    assert field in text and phrase in text


def test_unknown_field_is_rejected():
    with pytest.raises(ValidationError, match="theat"):
        DecodeConfig(theat=0.1)


def test_sdd_and_train_configs_reject():
    with pytest.raises(ValidationError, match=r"steps \(9\) must be <= gamma \(8\)"):
        DecodeConfig(method="sdd", gamma=8, steps=9)
    with pytest.raises(ValidationError, match="signal 'marginal' needs survival"):
        DecodeConfig(method="sdd-skip", signal="marginal")
    with pytest.raises(ValidationError, match="warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValidationError, match="lr"):
        TrainConfig(lr=0)


@pytest.mark.parametrize("name", ["tiny", "smollm2", "paper-32b-3b", "paper-sdd-diffucoder"])
def test_presets_validate(name):
    preset = load_preset(name)
    for model, fields in ((DecodeConfig, preset["decode"]), (TrainConfig, preset.get("train", {}))):
        config = model(**fields)  # (validates: a preset out of range fails here)
        for key, value in fields.items():  # every field is read as written, none ignored or renamed
            read = getattr(config, key)
            assert getattr(read, "value", read) == value, (name, key)


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="tiny"):
        load_preset("nope")


def test_config_round_trips_json():
    cfg = DecodeConfig(method="prove", theta=0.05, gate="verifier")
    assert DecodeConfig(**json.loads(cfg.model_dump_json())) == cfg


def test_self_distillation_defaults_to_the_recommended_teacher_anchor():
    """One default, stated once: `--self-distill` without `--anchor` is teacher-anchored (the
    recipe the README recommends and the zoo was built with); without self-distillation there
    is no teacher, and the clean copy is CE on the data."""
    assert TrainConfig().resolved_anchor(self_distill=True) == "teacher"
    assert TrainConfig().resolved_anchor(self_distill=False) == "self"
    assert TrainConfig(anchor="self").resolved_anchor(self_distill=True) == "self"


def test_the_sdd_block_has_one_default_for_the_cli_and_the_engine():
    """Mode `sdd` through additional_config drafts the CLI's gamma unless told otherwise; the
    ProVe modes keep B."""
    from vllm_prove.config import ProveEngineConfig

    assert ProveEngineConfig(mode="sdd", drafter="d").block_size == DecodeConfig().gamma == 16
    assert ProveEngineConfig(mode="sdd", drafter="d", block_size=32).block_size == 32
    assert ProveEngineConfig(mode="lossless").block_size == DecodeConfig().block_size == 8
