"""`vllm-prove zoo build`: train the tiny proposer and verifier on the stdlib corpus.

Recipe (all on CPU, scale `full` fits 90 minutes on 2 idle cores):
  1. byte-level BPE tokenizer (4,096 ids incl. `<|endoftext|>`, `<|mask|>`) on the train files;
  2. verifier (~0.9M params, Qwen2): AR pre-training;
  3. proposer (~5.8M params, Qwen2): stage 1 AR on the corpus;
  4. proposer stage 2, *self-distilled, teacher-anchored* MARS (train/distill.py): the masks learn
     the stage-1 model's greedy continuations of corpus contexts (fresh contexts every round), and
     the clean copy is held to the stage-1 model by KL at every position, so the shipped model
     keeps stage 1's greedy output and its likelihood of real text. Block sizes drawn from
     {8, 16} per step, so one model serves B = 4, 8 and 16 (the block-size sweep in
     docs/BENCHMARKS.md);
  5. verifier fine-tuned on the final proposer's greedy generations (ProVe §4.1);
  6. diffusion drafter (docs/METHODS.md §7): the fine-tuned verifier's weights trained as a
     block-diffusion LM (causal prefix, bidirectional draft block, Dream-style shifted logits) on
     the final proposer's greedy continuations, gamma drawn from {8, 16, 32}; the proposer is the
     SDD methods' AR target;
  7. weights saved in bf16; every held-out number is measured on those bf16 weights run in fp32.

`--resume` continues an interrupted build from each stage's last checkpoint in `<out>.work/`.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from vllm_prove.config import TrainConfig
from vllm_prove.errors import ProveError
from vllm_prove.train.data import StreamDataset, encode_stream
from vllm_prove.train.trainer import heldout_loss, train
from vllm_prove.train.distill import build_targets, distill_dataset, greedy_agreement, self_distill_mars
from vllm_prove.zoo import corpus as corpus_mod
from vllm_prove.zoo.evaluate import block_match, drafter_match
from vllm_prove.zoo.tokenizer import train_tokenizer

from vllm_prove.zoo import ZOO_DIR
BLOCK_SIZE = 8  # the decoding default; the proposer is trained for every B in TRAIN_BLOCK_SIZES' range
TRAIN_BLOCK_SIZES = (8, 16)
VOCAB_SIZE = 4096
NUM_HELDOUT_PROMPTS = 64

ARCH = {  # Qwen2 shapes; head_dim 64 is one the CPU and CUDA attention backends both support
    "proposer": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "verifier": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=64),
}

SCALES = {  # optimizer steps per stage, self-distillation sizes and held-out windows measured; `smoke`
    # runs the whole recipe in about a minute
    "full": dict(verifier_ar=500, proposer_ar=400, distill_rounds=2, distill_steps=400, distill_contexts=8192,
                 verifier_ft=300, verifier_contexts=4096, agreement_contexts=64, drafter=800, heldout_windows=128),
    "smoke": dict(verifier_ar=4, proposer_ar=4, distill_rounds=2, distill_steps=3, distill_contexts=16,
                  verifier_ft=3, verifier_contexts=16, agreement_contexts=4, drafter=3, heldout_windows=8),
}
DISTILL_NEW_TOKENS = 64
DRAFTER_GAMMAS = (8, 16, 32)  # the drafter trains on all three: the SDD sweeps vary gamma
DRAFTER_GAMMA, DRAFTER_STEPS = 16, 2  # the zoo's SDD default (configs/tiny.json) and its diagnostic
# Dream-style shifted logits: the AR weights it starts from already predict p from p - 1, so the
# first draft token is the AR prediction and the rest keep that alignment. Measured (200 steps,
# an earlier build of the zoo, strict SDD, gamma 16, T 2): 6.54 tokens per round shifted, 3.37 unshifted.
DRAFTER_SHIFT = True


HELDOUT_WINDOWS = (128, 96)  # held-out diagnostics: 128 corpus windows, 96 tokens of context each


def corpus_stream(tok, files) -> StreamDataset:
    """256-token windows of `files` encoded by `tok` (documents joined by EOS)."""
    return StreamDataset(encode_stream(tok, [f.text for f in files]), 256)


def open_zoo(out_dir: Path):
    """The shipped zoo as users load it: its tokenizer and a loader of its models (fp32, eval)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir / "proposer")
    return tok, lambda role: AutoModelForCausalLM.from_pretrained(out_dir / role, dtype=torch.float32).eval()


def heldout_windows(heldout_ds: StreamDataset, n: int = HELDOUT_WINDOWS[0]) -> torch.Tensor:
    """The held-out contexts every manifest diagnostic reads (fixed seed) # [n, 96]."""
    return heldout_ds.sample(n, torch.Generator().manual_seed(99)).input_ids[:, :HELDOUT_WINDOWS[1]]


def make_model(role: str, tokenizer, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=2048, rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                      **ARCH[role])
    cfg.mask_token_id = tokenizer.mask_token_id
    cfg._attn_implementation = "sdpa"
    torch.manual_seed({"proposer": 1, "verifier": 2}[role])
    return Qwen2ForCausalLM(cfg).to(dtype)


def save_bf16(model, tokenizer, out: Path) -> None:
    """bf16 safetensors + tokenizer; the model in memory becomes exactly what loading `out` in
    fp32 gives: bf16-rounded parameters, fp32 buffers (RoPE's inv_freq is recomputed on load,
    not read from the file, so it must not keep the bf16 rounding of the round trip)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.to(torch.float32)
    for p in model.parameters():  # run evaluation on what was shipped
        p.data = p.data.to(torch.bfloat16).to(torch.float32)
    for name, b in model.named_buffers():
        b.data = buffers[name]


def heldout_diagnostics(proposer, verifier, heldout_ds: StreamDataset, windows: torch.Tensor,
                        mask_token_id: int) -> dict:
    """The manifest's held-out numbers of a proposer / verifier pair on ``windows`` (``heldout_windows``)
    and ``heldout_ds`` (fp32 forward passes)."""
    match = {b: block_match(proposer, windows, b, mask_token_id) for b in (4, BLOCK_SIZE, 16)}
    return {"heldout_loss": {"proposer": round(heldout_loss(proposer, heldout_ds), 4),
                             "verifier": round(heldout_loss(verifier, heldout_ds), 4)},
            "proposer_block_match_rate": [round(x, 4) for x in match[BLOCK_SIZE]["rate"]],
            "proposer_matching_prefix": {str(b): round(m["prefix"], 3) for b, m in match.items()}}


def check_corpus(manifest: dict, files: list) -> None:
    """Raise if this interpreter's standard library (the corpus) is not the one the zoo was built
    and measured on: its held-out windows, and so every held-out number, would differ."""
    recorded = manifest.get("corpus", {})
    here = corpus_mod.corpus_hash(files)
    if recorded.get("sha256") not in (None, here):
        raise ProveError(
            f"corpus: this Python's standard library ({sys.version.split()[0]}, corpus sha256 {here[:12]}) is not "
            f"the corpus the zoo was built and measured on (Python {recorded.get('python_version')}, sha256 "
            f"{recorded['sha256'][:12]}); its held-out numbers cannot be recomputed here: run with that Python, "
            "or rebuild the zoo (`vllm-prove zoo build`)")


def reevaluate_zoo(out_dir: Path = ZOO_DIR) -> dict:
    """Recompute the manifest's held-out numbers from the shipped weights, loaded as users load
    them (`vllm-prove zoo evaluate`); write them back; return the manifest."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    files = corpus_mod.load_corpus()
    check_corpus(manifest, files)
    tok, load = open_zoo(out_dir)
    heldout_ds = corpus_stream(tok, corpus_mod.split(files)[1])
    proposer, windows = load("proposer"), heldout_windows(heldout_ds)
    diag = heldout_diagnostics(proposer, load("verifier"), heldout_ds, windows, tok.mask_token_id)
    for role, loss in diag.pop("heldout_loss").items():
        manifest["models"][role]["heldout_loss"] = loss
    manifest.update(diag)
    if (out_dir / "drafter").exists():
        manifest["drafter_match"] = _drafter_diag(proposer, load("drafter"), windows, tok.mask_token_id)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def train_drafter(verifier, proposer, tok, train_ds: StreamDataset, work: Path, *, steps: int,
                  num_contexts: int, seed: int = 0, resume: bool = False) -> tuple[object, dict]:
    """Stage 6: a block-diffusion drafter from the verifier's weights, on the proposer's greedy
    continuations (the same fingerprinted targets the verifier fine-tuning read)."""
    drafter = copy.deepcopy(verifier).float().train()
    generations = build_targets(proposer, train_ds, work / "verifier_targets", num_contexts=num_contexts,
                                max_new_tokens=DISTILL_NEW_TOKENS, eos_id=tok.eos_token_id, seed=seed + 7,
                                generator_name="proposer@final")
    cfg = _stage(dict(objective="diffusion", block_size=DRAFTER_GAMMA, block_size_mix=DRAFTER_GAMMAS, lr=1e-3,
                      logits_shift=DRAFTER_SHIFT, seed=seed, batch_size=16, seq_len=256, checkpoint_every=100), steps)
    log = train(drafter, distill_dataset(generations, tok.eos_token_id), cfg, mask_token_id=tok.mask_token_id,
                out_dir=work / "drafter", desc="diffusion drafter", resume=resume)
    drafter.config.diffusion_drafter = {"kind": "block", "logits_shift": DRAFTER_SHIFT}
    return drafter, log


def build_drafter(out_dir: Path = ZOO_DIR, seed: int = 0, resume: bool = False, scale: str = "full") -> dict:
    """`vllm-prove zoo drafter`: (re)train only the drafter of an existing zoo (after its
    proposer changed); writes `out_dir/drafter` and the manifest's drafter entries."""
    out_dir = Path(out_dir)
    work = out_dir.parent / (out_dir.name + ".work")
    tok, load = open_zoo(out_dir)
    proposer, verifier = load("proposer"), load("verifier")
    train_files, heldout_files = corpus_mod.split(corpus_mod.load_corpus())
    train_ds, heldout_ds = corpus_stream(tok, train_files), corpus_stream(tok, heldout_files)
    steps = SCALES[scale]
    drafter, log = train_drafter(verifier, proposer, tok, train_ds, work, steps=steps["drafter"],
                                 num_contexts=steps["verifier_contexts"], seed=seed, resume=resume)
    save_bf16(drafter, tok, out_dir / "drafter")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    manifest["models"]["drafter"] = _model_entry("drafter", drafter)
    windows = heldout_windows(heldout_ds, steps["heldout_windows"])
    manifest["drafter_match"] = _drafter_diag(proposer, drafter, windows, tok.mask_token_id)
    manifest["training"]["drafter"] = {k: log[k] for k in ("step", "loss", "tokens", "seconds", "tokens_per_s")}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _drafter_diag(proposer, drafter, windows: torch.Tensor, mask_token_id: int) -> dict:
    m = drafter_match(proposer, drafter, windows, DRAFTER_GAMMA, DRAFTER_STEPS, mask_token_id)
    return {"gamma": DRAFTER_GAMMA, "steps": DRAFTER_STEPS, "strict_accepted": round(m["accepted"], 3),
            "rate": [round(x, 4) for x in m["rate"]]}


def _model_entry(role: str, model) -> dict:
    arch = ARCH["verifier" if role == "drafter" else role]
    entry = {"path": role, "arch": "Qwen2", "params": sum(p.numel() for p in model.parameters()),
             "dtype": "bfloat16", **arch}
    if role == "drafter":
        entry |= {"initialized_from": "verifier", "layout": "block diffusion (causal prefix, bidirectional block)"}
    return entry


def check_tokenizer_roundtrip(folder: Path, trained, text: str) -> None:
    """The tokenizer every loader builds from `folder` must tokenize exactly like the one the
    models were trained with (transformers rebuilds Qwen2 tokenizers: see zoo/tokenizer.py)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder)
    ours, theirs = trained(text)["input_ids"], loaded(text)["input_ids"]
    if ours != theirs:
        raise RuntimeError(f"{folder}: AutoTokenizer ({type(loaded).__name__}) tokenizes differently from "
                           "the trained tokenizer; the models would see other tokens than in training")


def _stage(cfg_kwargs: dict, steps: int) -> TrainConfig:
    warmup = min(50, max(0, steps // 10))
    return TrainConfig(**{**cfg_kwargs, "steps": steps, "warmup_steps": warmup})


def build_zoo(out_dir: Path = ZOO_DIR, scale: str = "full", seed: int = 0, resume: bool = False) -> dict:
    """Run the whole recipe; write `out_dir/{tokenizer is inside each model},proposer,verifier,
    manifest.json, heldout_prompts.jsonl}`; return the manifest. `resume` continues each stage
    from its last checkpoint in `<out_dir>.work/` (an interrupted build)."""
    steps = SCALES[scale]
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    work = out_dir.parent / (out_dir.name + ".work")
    files = corpus_mod.load_corpus()
    train_files, heldout_files = corpus_mod.split(files)
    tok = train_tokenizer([f.text for f in train_files], VOCAB_SIZE, work / "tokenizer")
    train_ds, heldout_ds = corpus_stream(tok, train_files), corpus_stream(tok, heldout_files)
    base = dict(block_size=BLOCK_SIZE, seed=seed, batch_size=16, seq_len=256, checkpoint_every=100)
    log: dict = {}

    verifier = make_model("verifier", tok)
    log["verifier_ar"] = train(verifier, train_ds, _stage({**base, "objective": "ar", "lr": 2e-3},
                               steps["verifier_ar"]), out_dir=work / "verifier_ar", desc="verifier AR", resume=resume)
    proposer = make_model("proposer", tok)
    log["proposer_ar"] = train(proposer, train_ds, _stage({**base, "objective": "ar", "lr": 2.5e-3},
                               steps["proposer_ar"]), out_dir=work / "proposer_ar", desc="proposer AR", resume=resume)
    teacher = copy.deepcopy(proposer).eval()  # the AR model: what self-distillation starts from and keeps
    windows = heldout_windows(heldout_ds, steps["heldout_windows"])
    agreement_contexts = [w.tolist() for w in windows[: steps["agreement_contexts"]]]
    log["proposer_ar"]["heldout_matching_prefix"] = round(block_match(proposer, windows, BLOCK_SIZE,
                                                                      tok.mask_token_id)["prefix"], 3)
    log["proposer_ar"]["heldout_loss"] = round(heldout_loss(proposer, heldout_ds), 4)

    def evaluate_round(model) -> dict:  # the three numbers a round trades against each other
        agree = greedy_agreement(teacher, model, agreement_contexts, DISTILL_NEW_TOKENS, tok.eos_token_id)
        return {"heldout_matching_prefix": round(block_match(model, windows, BLOCK_SIZE, tok.mask_token_id)["prefix"], 3),
                "heldout_loss": round(heldout_loss(model, heldout_ds), 4),
                "greedy_identical_to_ar_stage": agree["identical"]}

    distill_cfg = _stage({**base, "objective": "mars", "lr": 1e-3, "block_size_mix": TRAIN_BLOCK_SIZES,
                          "anchor": "teacher"}, steps["distill_steps"])
    rounds = self_distill_mars(proposer, train_ds, distill_cfg, work_dir=work / "proposer_distill",
                               mask_token_id=tok.mask_token_id, eos_id=tok.eos_token_id,
                               rounds=steps["distill_rounds"], num_contexts=steps["distill_contexts"],
                               max_new_tokens=DISTILL_NEW_TOKENS, resume=resume, name="proposer",
                               evaluate=evaluate_round)
    for r, round_log in enumerate(rounds):
        log[f"proposer_distill_{r}"] = round_log
    save_bf16(proposer, tok, out_dir / "proposer")
    check_tokenizer_roundtrip(out_dir / "proposer", tok, heldout_files[0].text[:20000])

    generations = build_targets(proposer, train_ds, work / "verifier_targets", num_contexts=steps["verifier_contexts"],
                                max_new_tokens=DISTILL_NEW_TOKENS, eos_id=tok.eos_token_id, seed=seed + 7,
                                generator_name="proposer@final")
    log["verifier_ft"] = train(verifier, distill_dataset(generations, tok.eos_token_id),
                               _stage({**base, "objective": "ar", "lr": 5e-4}, steps["verifier_ft"]),
                               out_dir=work / "verifier_ft", desc="verifier FT", resume=resume)
    save_bf16(verifier, tok, out_dir / "verifier")
    drafter, log["drafter"] = train_drafter(verifier, proposer, tok, train_ds, work, steps=steps["drafter"],
                                            num_contexts=steps["verifier_contexts"], seed=seed, resume=resume)
    save_bf16(drafter, tok, out_dir / "drafter")

    prompts = corpus_mod.heldout_prompts(heldout_files, NUM_HELDOUT_PROMPTS, seed=seed)
    corpus_mod.write_jsonl(prompts, out_dir / "heldout_prompts.jsonl")
    diag = heldout_diagnostics(proposer, verifier, heldout_ds, windows, tok.mask_token_id)
    manifest = {
        "command": "vllm-prove zoo build" + ("" if scale == "full" else f" --scale {scale}"),
        "scale": scale,
        "seed": seed,
        "corpus": corpus_mod.corpus_info(files),
        "tokenizer": {"type": "byte-level BPE", "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                      "mask_token_id": tok.mask_token_id},
        "block_size": BLOCK_SIZE,
        "models": {
            **{role: _model_entry(role, m) | {"heldout_loss": diag["heldout_loss"][role]}
               for role, m in (("proposer", proposer), ("verifier", verifier))},
            "drafter": _model_entry("drafter", drafter),
        },
        "train_block_sizes": list(TRAIN_BLOCK_SIZES),
        "proposer_block_match_rate": diag["proposer_block_match_rate"],
        "proposer_matching_prefix": diag["proposer_matching_prefix"],
        "greedy_agreement_with_ar_stage": greedy_agreement(
            teacher, proposer, agreement_contexts, DISTILL_NEW_TOKENS, tok.eos_token_id),
        "drafter_match": _drafter_diag(proposer, drafter, windows, tok.mask_token_id),
        "training": {k: {kk: v[kk] for kk in ("step", "loss", "tokens", "seconds", "tokens_per_s", "num_examples",
                                              "heldout_matching_prefix", "heldout_loss", "eval") if kk in v}
                     for k, v in log.items()},
        "build_seconds": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return manifest
