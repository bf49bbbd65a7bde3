"""`vllm-prove train mars|verifier`: the training recipes on any HF causal LM checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_prove.config import TrainConfig
from vllm_prove.train.data import load_dataset
from vllm_prove.train.trainer import train
from vllm_prove.train import MASK_TOKEN
from vllm_prove.errors import ProveError

ADAPTER_INFO = "prove_adapter.json"  # beside a shipped adapter: the mask token its base must gain

# MARS' own recipe for real checkpoints (docs/METHODS.md §2): lr 5e-6, max length 512.
FINETUNE_DEFAULTS = {"lr": 5e-6, "seq_len": 512, "warmup_steps": 20}


def _load(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return tok, model


def ensure_mask_token(tok, model) -> int:
    """Give the model a `<|mask|>` placeholder (new embedding row) unless it has one; record
    `mask_token_id` in its config (the key vLLM's parallel drafting reads too)."""
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None:
        if tok.mask_token is None:
            tok.add_special_tokens({"mask_token": MASK_TOKEN})
        mask_id = tok.mask_token_id
        if mask_id >= model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tok))
        model.config.mask_token_id = mask_id
    return mask_id


def attach_adapter(model, rank: int, mask_id: int, seed: int):
    """A low-rank adapter (alpha = 2 x rank) on every linear layer of `model`, and its mask
    token's embedding row as trainable tokens (peft); the base weights stay frozen. Seeded: the
    adapter's initial state is part of what a resumed run must find again."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                        trainable_token_indices=[mask_id])
    return get_peft_model(model, config)


def save_trained(lm, tok, out: str | Path) -> None:
    """Save a trained model to `out`. An adapter also lands in `out/adapter/`, the artefact to
    ship: its weights rounded to bf16 (half the bytes; the model saved in `out` is merged from
    the rounded weights, so it is exactly what merging the shipped adapter gives), the mask row
    as a trainable-token delta (not a whole embedding matrix), and `prove_adapter.json` naming
    the mask token a base tokenizer must gain."""
    out = Path(out)
    if hasattr(lm, "merge_and_unload"):
        from safetensors.torch import load_file, save_file

        for param in lm.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16).to(param.dtype)
        lm.save_pretrained(out / "adapter", save_embedding_layers=False)
        weights = out / "adapter" / "adapter_model.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
        (out / "adapter" / ADAPTER_INFO).write_text(json.dumps(
            {"mask_token": tok.mask_token, "mask_token_id": tok.mask_token_id}, indent=1) + "\n")
        lm = lm.merge_and_unload()
    lm.save_pretrained(out)
    tok.save_pretrained(out)


def train_mars(*, model: str, data: str, out: str, resume: bool = False, proposer=None, self_distill: bool = False,
               rounds: int = 1, num_contexts: int = 4096, max_new_tokens: int = 64, continuations=None,
               **overrides) -> dict:
    """Stage-2 MARS block training of `model` on `data`; the result is saved in `out`.

    `self_distill`: the targets are the model's own greedy continuations of contexts cut from
    `data` (plain text), fresh contexts each of `rounds` (`OUT/round-R/targets/`, resumable),
    written by the current model (`anchor="self"`) or by the frozen starting model, which then
    also anchors the clean copy (`anchor="teacher"`); `soft_weight` > 0 adds KL to the
    generator's next-token distribution in the block term. `continuations`: who writes the
    teacher's targets (`distill.build_targets`; default transformers' `generate`)."""
    if continuations is not None and not self_distill:
        raise ProveError("a targets engine writes self-distillation targets: it needs --self-distill")
    tok, lm = _load(model)
    torch.manual_seed(0)  # a new mask row's initial value is part of the teacher's fingerprint
    mask_id = ensure_mask_token(tok, lm)
    cfg = TrainConfig(**{**FINETUNE_DEFAULTS, **overrides, "objective": "mars"})
    cfg = cfg.model_copy(update={"anchor": cfg.resolved_anchor(self_distill)})
    ds = load_dataset(data, tok, cfg.seq_len)
    teacher = None
    if cfg.lora_rank:
        if self_distill and cfg.anchor == "teacher":
            import copy

            teacher = copy.deepcopy(lm)  # the plain starting model (an adapter's layers would slow it)
        lm = attach_adapter(lm, cfg.lora_rank, mask_id, cfg.seed)
    if self_distill:
        from vllm_prove.train.distill import self_distill_mars
        from vllm_prove.train.data import StreamDataset

        if not isinstance(ds, StreamDataset):
            raise ProveError(f"--self-distill cuts contexts from plain text; {data} holds prompt/response rows")
        logs = self_distill_mars(lm, ds, cfg, work_dir=out, mask_token_id=mask_id, eos_id=tok.eos_token_id,
                                 rounds=rounds, num_contexts=num_contexts, max_new_tokens=max_new_tokens,
                                 resume=resume, tokenizer=tok, name=str(model), teacher=teacher,
                                 continuations=continuations)
        save_trained(lm, tok, out)
        return logs[-1] | {"rounds": [{k: v for k, v in log.items() if k != "history"} for log in logs],
                           "out": str(Path(out)), "mask_token_id": mask_id}
    if cfg.soft_weight > 0 or cfg.anchor == "teacher":
        raise ProveError("soft_weight and anchor 'teacher' need --self-distill (the teacher is the generating model)")
    result = train(lm, ds, cfg, mask_token_id=mask_id, out_dir=out, tokenizer=tok, resume=resume, desc="MARS")
    save_trained(lm, tok, out)
    return result | {"out": str(Path(out)), "mask_token_id": mask_id}


def train_verifier(*, model: str, data: str, out: str, proposer: str, resume: bool = False,
                   max_new_tokens: int = 64, **overrides) -> dict:
    """Fine-tune verifier `model` on `proposer`'s greedy continuations of the prompts in `data`."""
    from vllm_prove.prompts import read_prompts
    from vllm_prove.train.verifier import verifier_dataset

    tok, lm = _load(model)
    p_tok, p_lm = _load(proposer)
    if len(p_tok) != len(tok) or p_tok.get_vocab() != tok.get_vocab():
        raise ProveError("verifier: its tokenizer differs from the proposer's; ProVe needs one vocabulary")
    cfg = TrainConfig(**{**FINETUNE_DEFAULTS, **overrides, "objective": "ar"})
    ds = verifier_dataset(p_lm.eval(), tok, read_prompts(data), max_new_tokens, cfg.seq_len)
    result = train(lm, ds, cfg, out_dir=out, tokenizer=tok, resume=resume, desc="verifier")
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    return result | {"out": str(Path(out))}


def train_diffusion(*, model: str, data: str, out: str, target: str | None = None, resume: bool = False,
                    num_contexts: int = 4096, max_new_tokens: int = 64, continuations=None, **overrides) -> dict:
    """Block-diffusion drafter training (docs/METHODS.md §7, train/diffusion.py) of `model`.

    With `target` (an AR checkpoint, recommended): the drafter learns the target's greedy
    continuations of contexts cut from `data` (plain text), generated once and stored in
    `OUT/targets/` (resumable, fingerprinted), since what a draft must match is the target's
    output. Without it: masked-block training on `data` itself. The drafter's config.json
    records its layout (`diffusion_drafter`: kind `block`, `logits_shift`) and its mask id. A
    student of a real checkpoint (`train/student.py`) trains with its projected embedding frozen,
    and `OUT/artefact/` holds what ships (`export_student`). `continuations`: who writes the
    target's continuations (`distill.build_targets`; default transformers' `generate`)."""
    from vllm_prove.train.student import copy_projection, export_student, freeze_embedding
    from vllm_prove.train.data import StreamDataset
    from vllm_prove.train.distill import build_targets, distill_dataset

    tok, lm = _load(model)
    mask_id = ensure_mask_token(tok, lm)
    cfg = TrainConfig(**{**FINETUNE_DEFAULTS, **overrides, "objective": "diffusion"})
    ds = load_dataset(data, tok, cfg.seq_len)
    if target is not None:
        t_tok, t_lm = _load(target)
        if t_tok.get_vocab() != tok.get_vocab():
            raise ProveError(f"--target {target}: its tokenizer differs from the drafter's; SDD needs one vocabulary")
        if not isinstance(ds, StreamDataset):
            raise ProveError(f"--target cuts contexts from plain text; {data} holds prompt/response rows")
        examples = build_targets(t_lm.eval(), ds, Path(out) / "targets", num_contexts=num_contexts,
                                 max_new_tokens=max_new_tokens, eos_id=tok.eos_token_id, seed=cfg.seed + 17,
                                 generator_name=str(target), continuations=continuations)
        if continuations is not None:
            continuations.close()
        ds = distill_dataset(examples, tok.eos_token_id)
    elif continuations is not None:
        raise ProveError("a targets engine writes the target's continuations: it needs --target")
    student = freeze_embedding(lm)
    result = train(lm, ds, cfg, mask_token_id=mask_id, out_dir=out, tokenizer=tok, resume=resume,
                   desc="diffusion drafter")
    lm.config.diffusion_drafter = {"kind": "block", "logits_shift": cfg.logits_shift}
    if student:
        result |= {"artefact": export_student(lm, model, Path(out) / "artefact")}
        copy_projection(model, out)
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    return result | {"out": str(Path(out)), "mask_token_id": mask_id}
