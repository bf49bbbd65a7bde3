"""A small, honest training loop: AdamW + cosine schedule, progress bar, checkpoints, resume.

Works for any HF causal LM (the zoo's tiny Qwen2 models or a real Qwen2.5): the objective is
`ar` (next-token CE), `mars` (docs/METHODS.md §2, see `mars.py`) or `diffusion` (a
block-diffusion drafter, docs/METHODS.md §7, see `diffusion.py`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_prove.config import TrainConfig
from vllm_prove.train.diffusion import diffusion_loss
from vllm_prove.train.mars import ar_loss, mars_loss
from vllm_prove.errors import ProveError

_CKPT = "checkpoint"  # sub-folder of out_dir holding the latest resumable state


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _save(model, tokenizer, opt, gen, step: int, out: Path, progress: dict) -> None:
    ckpt = out / _CKPT
    # an adapter's checkpoint is its own weights (the mask row as a trainable-token delta)
    model.save_pretrained(ckpt, **({"save_embedding_layers": False} if hasattr(model, "peft_config") else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(ckpt)
    # the global torch RNG drives dropout: without it a resumed run of a model with dropout diverges;
    # `progress` (last loss, tokens and seconds so far) makes a resumed stage report its whole run
    torch.save({"step": step, "optimizer": opt.state_dict(), "rng": gen.get_state(),
                "torch_rng": torch.get_rng_state(), "progress": progress}, ckpt / "trainer.pt")


def _load_weights(model, ckpt: Path) -> None:
    """Load a checkpoint written by `_save`: a whole model, or a low-rank adapter's weights."""
    from safetensors.torch import load_file

    if (ckpt / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(ckpt / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise ProveError(f"{ckpt}: adapter weights do not fit the model ({result.unexpected_keys[:4]})")
        return
    weights = load_file(ckpt / "model.safetensors")
    if getattr(model.config, "tie_word_embeddings", False):  # save_pretrained drops the tied copy
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    model.load_state_dict(weights, strict=True)


def train(model, dataset, cfg: TrainConfig, *, mask_token_id: int | None = None, out_dir: str | Path | None = None,
          tokenizer=None, resume: bool = False, desc: str = "train", log_every: int = 20, teacher=None) -> dict:
    """Train `model` in place; return `{"step", "loss", "tokens", "seconds", "tokens_per_s", "history"}`
    (a resumed stage counts its tokens and seconds from its first run; `history` is this run's).

    `teacher` (frozen; self-distillation with `cfg.soft_weight > 0` or `cfg.anchor == "teacher"`)
    gives the soft targets."""
    if cfg.objective in ("mars", "diffusion") and mask_token_id is None:
        raise ProveError(f"objective {cfg.objective!r} needs mask_token_id (config.json `mask_token_id` of the model)")
    needs_teacher = cfg.soft_weight > 0 or cfg.anchor == "teacher"
    if needs_teacher and (teacher is None or cfg.objective != "mars"):
        raise ProveError("soft_weight > 0 and anchor 'teacher' need objective 'mars' and a teacher model "
                         "(self-distillation)")
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    out = Path(out_dir) if out_dir is not None else None
    start, before = 0, {"loss": float("nan"), "tokens": 0, "seconds": 0.0}
    if resume and out is not None and (out / _CKPT / "trainer.pt").exists():
        state = torch.load(out / _CKPT / "trainer.pt", weights_only=True)
        _load_weights(model, out / _CKPT)
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["rng"])
        if "torch_rng" in state:  # absent from checkpoints written before it was saved
            torch.set_rng_state(state["torch_rng"])
        start = state["step"]
        before = state.get("progress", before)  # absent from checkpoints written before it was saved
    model.train()
    history, tokens, t0, loss_val = [], before["tokens"], time.perf_counter(), before["loss"]
    final_seconds = None  # the seconds the final checkpoint recorded, when this run wrote it
    bar = tqdm(range(start, cfg.steps), desc=desc, initial=start, total=cfg.steps, mininterval=2.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        batch = dataset.sample(cfg.batch_size, gen)
        block = cfg.block_size
        if cfg.block_size_mix and cfg.objective != "ar":
            block = cfg.block_size_mix[int(torch.randint(len(cfg.block_size_mix), (1,), generator=gen))]
        if cfg.objective == "mars":
            teacher_logits = None
            if needs_teacher:
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=batch.input_ids).logits  # [batch, seq, vocab]
            parts = mars_loss(model, batch, mask_token_id, block, cfg.ar_weight, teacher_logits, cfg.soft_weight,
                              cfg.anchor)
        elif cfg.objective == "diffusion":
            parts = diffusion_loss(model, batch, mask_token_id, block, gen, cfg.min_mask_ratio, cfg.logits_shift)
        else:
            parts = ar_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tokens += batch.input_ids.numel()
        loss_val = parts["loss"].item()
        if step % log_every == 0 or step == cfg.steps - 1:
            history.append({"step": step, **{k: round(v.item(), 4) for k, v in parts.items()}})
            bar.set_postfix({k: f"{v.item():.3f}" for k, v in parts.items()})
        if out is not None and ((step + 1) % cfg.checkpoint_every == 0 or step == cfg.steps - 1):
            # the stage's seconds are its training time, saves excluded: a resumed finished stage
            # then reports exactly what its run reported
            progress = {"loss": loss_val, "tokens": tokens, "seconds": before["seconds"] + time.perf_counter() - t0}
            _save(model, tokenizer, opt, gen, step + 1, out, progress)
            final_seconds = progress["seconds"]
    model.eval()
    seconds = final_seconds if final_seconds is not None else before["seconds"] + time.perf_counter() - t0
    return {"step": cfg.steps, "loss": loss_val, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "history": history}


@torch.no_grad()
def heldout_loss(model, dataset, num_batches: int = 8, batch_size: int = 8, seed: int = 1234) -> float:
    """Mean next-token CE on held-out windows (nats/token)."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    losses = [ar_loss(model, dataset.sample(batch_size, gen))["ar"].item() for _ in range(num_batches)]
    return sum(losses) / len(losses)
