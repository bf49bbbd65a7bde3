"""`vllm-prove zoo build`: train the tiny proposer and verifier on the stdlib corpus.

Recipe (all on CPU, about 28 minutes on 2 idle cores at scale `full`):
  1. byte-level BPE tokenizer (4,096 ids incl. `<|endoftext|>`, `<|mask|>`) on the train files;
  2. verifier (~0.9M params, Qwen2): AR pre-training;
  3. proposer (~5.8M params, Qwen2): stage 1 AR, stage 2 MARS block training with B = 8;
  4. verifier fine-tuned on proposer generations (ProVe §4.1);
  5. weights saved in bf16; every held-out number is measured on those bf16 weights run in fp32.

B = 8 (the paper uses 16): a 6M-parameter model's block match to its own greedy continuation
falls fast with distance, so positions past ~8 are nearly never accepted while each one still
costs a query token in every window pass; 8 keeps the window cheap and leaves headroom.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from vllm_prove.config import TrainConfig
from vllm_prove.train.data import StreamDataset, encode_stream
from vllm_prove.train.trainer import heldout_loss, train
from vllm_prove.train.verifier import verifier_dataset
from vllm_prove.zoo import corpus as corpus_mod
from vllm_prove.zoo.evaluate import block_match_rate
from vllm_prove.zoo.tokenizer import train_tokenizer

from vllm_prove.zoo import ZOO_DIR
BLOCK_SIZE = 8
VOCAB_SIZE = 4096
NUM_HELDOUT_PROMPTS = 64

ARCH = {  # Qwen2 shapes; head_dim 64 is one the CPU and CUDA attention backends both support
    "proposer": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "verifier": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=64),
}

SCALES = {  # optimizer steps per stage; `smoke` exercises the whole recipe in ~1 minute
    "full": dict(verifier_ar=500, proposer_ar=250, proposer_mars=560, verifier_ft=120, gen_prompts=512),
    "smoke": dict(verifier_ar=4, proposer_ar=4, proposer_mars=4, verifier_ft=3, gen_prompts=8),
}


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
    """bf16 safetensors + tokenizer; reload in fp32 gives exactly the bf16-rounded weights."""
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.to(torch.float32)
    for p in model.parameters():  # run evaluation on what was shipped
        p.data = p.data.to(torch.bfloat16).to(torch.float32)


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
    train_ds = StreamDataset(encode_stream(tok, [f.text for f in train_files]), 256)
    heldout_ds = StreamDataset(encode_stream(tok, [f.text for f in heldout_files]), 256)
    base = dict(block_size=BLOCK_SIZE, seed=seed, batch_size=16, seq_len=256, checkpoint_every=100)
    log: dict = {}

    verifier = make_model("verifier", tok)
    log["verifier_ar"] = train(verifier, train_ds, _stage({**base, "objective": "ar", "lr": 2e-3},
                               steps["verifier_ar"]), out_dir=work / "verifier_ar", desc="verifier AR", resume=resume)
    proposer = make_model("proposer", tok)
    log["proposer_ar"] = train(proposer, train_ds, _stage({**base, "objective": "ar", "lr": 2.5e-3},
                               steps["proposer_ar"]), out_dir=work / "proposer_ar", desc="proposer AR", resume=resume)
    log["proposer_mars"] = train(proposer, train_ds, _stage({**base, "objective": "mars", "lr": 1.5e-3},
                                 steps["proposer_mars"]), mask_token_id=tok.mask_token_id,
                                 out_dir=work / "proposer_mars", desc="proposer MARS", resume=resume)
    save_bf16(proposer, tok, out_dir / "proposer")
    check_tokenizer_roundtrip(out_dir / "proposer", tok, heldout_files[0].text[:20000])

    gen_prompts = [f.text[:400] for f in train_files][: steps["gen_prompts"]]
    ft_ds = verifier_dataset(proposer, tok, gen_prompts, max_new_tokens=64, seq_len=160)
    log["verifier_ft"] = train(verifier, ft_ds, _stage({**base, "objective": "ar", "lr": 5e-4, "seq_len": 160},
                               steps["verifier_ft"]), out_dir=work / "verifier_ft", desc="verifier FT", resume=resume)
    save_bf16(verifier, tok, out_dir / "verifier")

    prompts = corpus_mod.heldout_prompts(heldout_files, NUM_HELDOUT_PROMPTS, seed=seed)
    corpus_mod.write_jsonl(prompts, out_dir / "heldout_prompts.jsonl")
    windows = heldout_ds.sample(128, torch.Generator().manual_seed(99)).input_ids[:, :96]
    manifest = {
        "command": "vllm-prove zoo build" + ("" if scale == "full" else f" --scale {scale}"),
        "scale": scale,
        "seed": seed,
        "corpus": corpus_mod.corpus_info(files),
        "tokenizer": {"type": "byte-level BPE", "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                      "mask_token_id": tok.mask_token_id},
        "block_size": BLOCK_SIZE,
        "models": {
            role: {"path": role, "arch": "Qwen2", "params": sum(p.numel() for p in m.parameters()),
                   "dtype": "bfloat16", **ARCH[role],
                   "heldout_loss": round(heldout_loss(m, heldout_ds), 4)}
            for role, m in (("proposer", proposer), ("verifier", verifier))
        },
        "proposer_block_match_rate": [round(x, 4) for x in block_match_rate(proposer, windows, BLOCK_SIZE,
                                                                              tok.mask_token_id)],
        "training": {k: {kk: v[kk] for kk in ("step", "loss", "tokens", "seconds", "tokens_per_s")}
                     for k, v in log.items()},
        "build_seconds": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return manifest
