"""A small model on a base checkpoint's tokenizer, to train as its diffusion drafter (or verifier).

With a real vocabulary the embedding is most of a small model: 49,152 x 192 is 9.4M of a 6-layer,
192-wide student's 11.8M parameters, and most of what shipping it would cost. The student's
embedding is therefore the base's own, projected onto its leading principal directions:

    E_student = E_base @ P      P: [base hidden, hidden], the top right singular vectors of the
                                centred E_base, each direction's sign fixed (largest entry > 0)

frozen in training (the output layer is tied to it). What ships is the rest of the student (bf16)
and P (fp32); ``rebuild_student`` recomputes the embedding from the base checkpoint and writes
the whole folder, bit for bit the model that training saved. The mask placeholder is a special
token the base's vocabulary already has and text never contains, so the student's vocabulary is
the base's and a vLLM draft model of it shares the target's output space.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_prove.errors import ProveError

PROJECTION = "prove_student/embed_projection.safetensors"  # (a sub-folder: vLLM loads every top-level *.safetensors)
WEIGHTS = "model.safetensors"
STUDENT_KEY = "prove_student"  # config.json: {"base_hidden", "projection"}


def projection(embed: torch.Tensor, hidden: int) -> torch.Tensor:
    """# [base hidden, hidden] fp32: the top ``hidden`` principal directions of ``embed`` # [vocab, base hidden]."""
    if not 0 < hidden <= embed.shape[1]:
        raise ProveError(f"hidden: must be in [1, {embed.shape[1]}] (the base's width), got {hidden}")
    centred = embed.double() - embed.double().mean(0)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    p = vh[:hidden].T  # [base hidden, hidden]
    sign = torch.sign(p.gather(0, p.abs().argmax(0, keepdim=True)))  # [1, hidden]
    return (p * sign).float().contiguous()


def projected_embedding(base_embed: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return base_embed.float() @ p  # [vocab, hidden]


def _base_embedding(base: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return model.get_input_embeddings().weight.detach()


def build_student(base: str | Path, out: str | Path, *, hidden: int = 192, layers: int = 6, heads: int = 3,
                  kv_heads: int = 1, intermediate: int = 512, mask_token: str, seed: int = 0) -> dict:
    """Write an untrained student of ``base`` to ``out`` (an HF folder with the base's tokenizer,
    config key ``prove_student``, and ``PROJECTION``); return its summary."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base, out = Path(base), Path(out)
    tok = AutoTokenizer.from_pretrained(base)
    mask_id = tok.convert_tokens_to_ids(mask_token)
    if mask_id is None or mask_id == tok.unk_token_id or tok.convert_ids_to_tokens(mask_id) != mask_token:
        raise ProveError(f"mask_token: {mask_token!r} is not a token of {base}'s vocabulary")
    if hidden % heads or heads % kv_heads:
        raise ProveError(f"heads: hidden ({hidden}) must split into heads ({heads}), heads into kv_heads ({kv_heads})")
    config = AutoConfig.from_pretrained(base)
    embed = _base_embedding(base)
    config.update({"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "head_dim": hidden // heads,
                   "tie_word_embeddings": True, "mask_token_id": mask_id, "dtype": "float32",
                   STUDENT_KEY: {"base_hidden": embed.shape[1], "projection": PROJECTION}})
    if getattr(config, "layer_types", None):  # (Qwen2-style configs list one type per layer)
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    p = projection(embed, hidden)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(projected_embedding(embed, p))
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _write_projection(p, out)
    count = sum(t.numel() for t in model.parameters())
    centred = embed.double() - embed.double().mean(0)
    kept = float((centred @ p.double()).pow(2).sum() / centred.pow(2).sum())  # P's columns are orthonormal
    return {"out": str(out), "num_parameters": count, "embedding_parameters": model.get_input_embeddings().weight.numel(),
            "mask_token": mask_token, "mask_token_id": mask_id, "hidden": hidden, "layers": layers,
            "embedding_variance_kept": round(kept, 4)}


def _write_projection(p: torch.Tensor, out: Path) -> None:
    from safetensors.torch import save_file

    (out / PROJECTION).parent.mkdir(parents=True, exist_ok=True)
    save_file({"projection": p}, out / PROJECTION)


def copy_projection(src: str | Path, out: str | Path) -> None:
    (Path(out) / PROJECTION).parent.mkdir(parents=True, exist_ok=True)
    (Path(out) / PROJECTION).write_bytes((Path(src) / PROJECTION).read_bytes())


def freeze_embedding(model) -> bool:
    """Freeze a student's (projected, tied) embedding; False where ``model`` is no student."""
    if STUDENT_KEY not in model.config.to_dict():
        return False
    model.get_input_embeddings().weight.requires_grad_(False)
    return True


def export_student(model, folder: str | Path, out: str | Path) -> dict:
    """The shippable artefact of a trained student: every weight but the embedding, rounded to
    bf16, its config and ``PROJECTION``. The model is rounded in place, so the folder saved after
    this is exactly what ``rebuild_student`` gives."""
    from safetensors.torch import save_file

    folder, out = Path(folder), Path(out)
    embed = model.get_input_embeddings().weight
    weights = {}
    for name, param in model.named_parameters():
        if param is embed:
            continue
        param.data = param.data.to(torch.bfloat16).to(param.dtype)
        weights[name] = param.detach().to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / WEIGHTS)
    model.config.to_json_file(out / "config.json")
    copy_projection(folder, out)
    return {"out": str(out), "shipped_parameters": sum(w.numel() for w in weights.values())}


def rebuild_student(artefact: str | Path, base: str | Path, out: str | Path) -> int:
    """Write the whole student folder at ``out`` from its artefact and the base checkpoint (the
    tokenizer is the base's); return its parameter count."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    artefact, base, out = Path(artefact), Path(base), Path(out)
    config = AutoConfig.from_pretrained(artefact)
    info = config.to_dict().get(STUDENT_KEY)
    if info is None:
        raise ProveError(f"{artefact}: config.json has no {STUDENT_KEY!r}: not a student artefact")
    embed = _base_embedding(base)
    if embed.shape[1] != info["base_hidden"]:
        raise ProveError(f"{artefact}: built on a base of width {info['base_hidden']}, {base} is {embed.shape[1]} wide")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {k: v.float() for k, v in load_file(artefact / WEIGHTS).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    embed_names = {n for n, t in model.named_parameters() if t is model.get_input_embeddings().weight}
    if unexpected or set(missing) - embed_names - {"lm_head.weight"}:
        raise ProveError(f"{artefact}: weights do not fit its config (missing {missing[:4]}, unexpected {unexpected[:4]})")
    p = load_file(artefact / PROJECTION)["projection"]
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(projected_embedding(embed, p))
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    copy_projection(artefact, out)
    return sum(t.numel() for t in model.parameters())
