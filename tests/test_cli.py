"""The `vllm-prove generate` contract: files in, OUT.jsonl + SUMMARY.json out, clear errors."""

from __future__ import annotations

import json

import pytest

from vllm_prove.cli import main
from vllm_prove.train.survival import load_traces

OUT_KEYS = {"index", "prompt", "token_ids", "text", "num_tokens", "cycles", "seconds"}
SUMMARY_KEYS = {"method", "engine", "num_tokens", "seconds", "tokens_per_s", "cycles", "committed_per_cycle", "passes"}


@pytest.fixture
def prompt_files(tmp_path, heldout_prompts):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(heldout_prompts[:3])))
    txt = tmp_path / "p.txt"
    txt.write_text("def main():\n\nimport os\nclass Foo:\n")
    return jsonl, txt


@pytest.mark.parametrize("method", ["ar", "prove-lossless", "prove", "mars", "sd", "sdd", "sdd-lenience", "sdd-topk",
                                    "sdd-skip"])
def test_generate_writes_the_contract(tmp_path, prompt_files, method):
    jsonl, _ = prompt_files
    out, summary = tmp_path / "runs" / "out.jsonl", tmp_path / "summaries" / "summary.json"  # folders not there yet
    rc = main(["generate", "--engine", "reference", "--method", method, "--prompts", str(jsonl),
               "--max-tokens", "6", "--batch-size", "2", "--out", str(out), "--summary", str(summary)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert set(r) == OUT_KEYS and r["num_tokens"] == len(r["token_ids"]) == 6
    s = json.loads(summary.read_text())
    assert SUMMARY_KEYS <= set(s) and s["method"] == method and s["num_tokens"] == 18
    if method.startswith("sdd"):
        assert {"verifier_calls", "draft_blocks", "verifier_calls_per_token", "gamma", "steps"} <= set(s)


@pytest.mark.slow
def test_sdd_traces_train_survival_and_permutation(tmp_path, heldout_prompts, capsys):
    """generate --trace-features -> train survival -> sdd-skip with each learned signal ->
    analyze permutation, through the CLI as a user runs it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in heldout_prompts[:16]))
    base = ["--prompts", str(prompts), "--max-tokens", "32", "--batch-size", "8"]
    trace, feats = tmp_path / "t.jsonl", tmp_path / "f.pt"
    assert main(["generate", "--method", "sdd", *base, "--out", str(tmp_path / "o.jsonl"), "--trace", str(trace),
                 "--trace-features", str(feats)]) == 0
    rounds = [json.loads(x) for x in trace.read_text().splitlines()]
    assert rounds and all(r["verified"] for r in rounds)
    capsys.readouterr()
    assert main(["train", "survival", "--traces", str(feats), "--epochs", "2", "--out", str(tmp_path / "surv")]) == 0
    reports = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["signal"] for r in reports] == ["marginal", "conditional"]
    for signal in ("marginal", "conditional"):
        summary = tmp_path / f"{signal}.json"
        assert main(["generate", "--method", "sdd-skip", "--signal", signal, "--survival", str(tmp_path / "surv"),
                     *base, "--out", str(tmp_path / "s.jsonl"), "--summary", str(summary)]) == 0
        assert json.loads(summary.read_text())["signal"] == signal
    assert main(["analyze", "permutation", "--traces", str(feats), "--repeats", "5",
                 "--out", str(tmp_path / "perm.json")]) == 0
    perm = json.loads((tmp_path / "perm.json").read_text())
    # the realized rounds: a confident prefix that fits inside each round's draft, and agreement
    # with strict SDD as shares
    traces = load_traces(str(feats))
    assert perm["repeats"] == 5 and 0 < perm["mean_prefix_realized"] <= float(traces.num_draft_tokens.double().mean())
    assert 0 < perm["strict_token_realized"] <= 1 and 0 <= perm["full_prefix_realized"] <= 1
    capsys.readouterr()
    assert main(["analyze", "permutation", "--traces", str(feats), "--signal", "marginal",
                 "--survival", str(tmp_path / "nowhere")]) == 2
    assert "nowhere/marginal.pt does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("args,phrase", [
    (["--method", "sdd-skip", "--signal", "marginal"], "signal 'marginal' needs survival"),
    (["--method", "sdd-skip", "--signal", "marginal", "--survival", "nowhere"], "nowhere/marginal.pt does not exist"),
    (["--method", "sdd", "--gamma", "4", "--steps", "5"], "steps (5) must be <= gamma (4)"),
    (["--method", "ar", "--trace", "t.jsonl"], "only the SDD methods"),
])
def test_bad_sdd_settings_exit_2(tmp_path, prompt_files, capsys, args, phrase):
    jsonl, _ = prompt_files
    rc = main(["generate", "--prompts", str(jsonl), "--max-tokens", "4", "--out", str(tmp_path / "o.jsonl"), *args])
    assert rc == 2
    assert phrase in capsys.readouterr().err


def test_drafter_whose_mask_ids_disagree_is_rejected(tmp_path, prompt_files, capsys):
    import shutil

    from vllm_prove.zoo import ZOO_DIR

    drafter = tmp_path / "drafter"
    shutil.copytree(ZOO_DIR / "drafter", drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["mask_token_id"] = 7
    (drafter / "config.json").write_text(json.dumps(cfg))
    jsonl, _ = prompt_files
    rc = main(["generate", "--method", "sdd", "--drafter", str(drafter), "--prompts", str(jsonl), "--max-tokens", "4",
               "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "drafter config mask_token_id = 7" in err and "drafter tokenizer mask_token_id = 1" in err


def test_sdd_gamma_beyond_the_engine_range_names_gamma(tmp_path, prompt_files, capsys):
    jsonl, _ = prompt_files
    rc = main(["generate", "--engine", "vllm", "--method", "sdd", "--gamma", "100", "--prompts", str(jsonl),
               "--max-tokens", "4", "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2
    assert "gamma: --engine vllm drafts at most 64 tokens per block" in capsys.readouterr().err


def test_sdd_traces_are_a_reference_engine_feature(tmp_path, prompt_files, capsys):
    jsonl, _ = prompt_files
    rc = main(["generate", "--engine", "vllm", "--method", "sdd", "--prompts", str(jsonl), "--max-tokens", "4",
               "--out", str(tmp_path / "o.jsonl"), "--trace", str(tmp_path / "t.jsonl")])
    assert rc == 2
    assert "only the reference engine writes per-round traces" in capsys.readouterr().err


def test_txt_prompts_and_same_tokens_for_lossless_and_ar(tmp_path, prompt_files):
    _, txt = prompt_files
    outs = {}
    for method in ("ar", "prove-lossless"):
        out = tmp_path / f"{method}.jsonl"
        assert main(["generate", "--method", method, "--prompts", str(txt), "--max-tokens", "12",
                     "--out", str(out)]) == 0
        outs[method] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert len(outs["ar"]) == 3 and outs["ar"] == outs["prove-lossless"]


@pytest.mark.parametrize("args,phrase", [
    (["--theta", "0"], "theta"),
    (["--block-size", "1"], "block_size"),
    (["--batch-size", "0"], "batch_size"),
])
def test_bad_flags_exit_2_naming_the_field(tmp_path, prompt_files, capsys, args, phrase):
    jsonl, _ = prompt_files
    rc = main(["generate", "--method", "prove", "--prompts", str(jsonl), "--max-tokens", "4",
               "--out", str(tmp_path / "o.jsonl"), *args])
    assert rc == 2
    assert phrase in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_prompt_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert main(["generate", "--method", "ar", "--prompts", str(bad), "--max-tokens", "4",
                 "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "prompt" in capsys.readouterr().err


def test_proposer_without_mask_token_is_rejected(tmp_path, zoo_models, capsys):
    from vllm_prove.zoo import ZOO_DIR

    folder = tmp_path / "nomask"
    zoo_models.proposer.save_pretrained(folder)
    zoo_models.tokenizer.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("mask_token_id")
    (folder / "config.json").write_text(json.dumps(cfg))
    txt = tmp_path / "p.txt"
    txt.write_text("import os\n")
    rc = main(["generate", "--method", "prove-lossless", "--proposer", str(folder), "--prompts", str(txt),
               "--max-tokens", "4", "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2 and "mask_token_id" in capsys.readouterr().err
    assert (ZOO_DIR / "proposer" / "config.json").exists()


def test_verifier_with_another_vocabulary_is_rejected(tmp_path, capsys):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = tmp_path / "other_vocab"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=1, num_key_value_heads=1, head_dim=64)).save_pretrained(other)
    txt = tmp_path / "p.txt"
    txt.write_text("import os\n")
    rc = main(["generate", "--method", "prove", "--verifier", str(other), "--prompts", str(txt),
               "--max-tokens", "4", "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "verifier" in err and "vocabulary" in err


def test_serve_passes_every_flag_to_vllm_serve(monkeypatch):
    from vllm_prove.engine import serve

    seen = {}
    monkeypatch.setattr(serve, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    flags = ["MODEL", "--additional-config", '{"prove": {"mode": "lossless"}}', "--port", "8011"]
    assert main(["serve", *flags]) == 0
    assert seen["argv"] == ["serve", *flags]


def test_zoo_prompts_cuts_heldout_prompts_from_any_code(tmp_path, capsys):
    src = tmp_path / "pkg"
    src.mkdir()
    for i in range(3):
        (src / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(30)))
    out = tmp_path / "prompts.jsonl"
    assert main(["zoo", "prompts", "--root", str(src), "--num", "10", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10
    for row in rows:
        path, line = row["source"].rsplit(":", 1)
        text = (src / path).read_text()
        start = sum(len(x) for x in text.splitlines(keepends=True)[: int(line) - 1])
        assert text[start:].startswith(row["prompt"])  # a verbatim slice at a line start


def test_unexpected_errors_keep_their_traceback(tmp_path, monkeypatch):
    """Only the project's own input errors become a one-line exit 2; a bug stays a traceback."""
    from vllm_prove import cli

    def broken(args):
        raise ValueError("an internal bug, not a user error")

    monkeypatch.setitem(cli.COMMANDS, "zoo", broken)
    with pytest.raises(ValueError, match="internal bug"):
        main(["zoo", "info"])


@pytest.mark.parametrize("args,phrase", [
    (["--targets-engine", "vllm"], "it needs --self-distill"),
    (["--lora-rank", "-1"], "lora_rank"),
])
def test_bad_train_mars_settings_exit_2_before_training(tmp_path, capsys, args, phrase):
    from vllm_prove.paths import zoo_path

    data = tmp_path / "d.txt"
    data.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "out"
    rc = main(["train", "mars", "--model", zoo_path("proposer"), "--data", str(data), "--out", str(out), *args])
    assert rc == 2
    assert phrase in capsys.readouterr().err
    assert not out.exists()  # nothing written
