"""Self-distillation targets for MARS training: the model's own greedy continuations.

What a mask position has to predict, for the lossless check and for the product gate alike, is
the proposer's *own* greedy continuation, not the corpus (blockwise parallel decoding, CLLM,
EAGLE and Medusa-2 train their drafters on the target's outputs the same way; docs/METHODS.md).
So the targets are made by the model itself:

    contexts   random corpus windows, lengths drawn from a few buckets (no padding in generation)
    targets    greedy continuation of each context, batched with a KV cache (`generate`)
    dataset    a folder of shards + `meta.json` recording the generating checkpoint's fingerprint;
               an interrupted generation resumes at the first missing shard

A `TokenBatch` of it marks the continuation as the response: MARS masks exactly those tokens in
its noisy copy, and its AR loss on the same tokens keeps the model's greedy behaviour.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_prove.core.metrics import common_prefix_length
from vllm_prove.train.data import ExampleDataset, StreamDataset
from vllm_prove.errors import ProveError

CONTEXT_BUCKETS = (32, 48, 64, 80, 96, 112, 128)  # context lengths (tokens) of the distillation prompts


def fingerprint(model) -> str:
    """A stable hash of a model's weights (a strided sample of every tensor, names and shapes):
    the dataset records which checkpoint wrote it, so stale targets are never reused silently."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(flat[::step].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def sample_contexts(stream: StreamDataset, num: int, seed: int,
                    buckets: tuple[int, ...] = CONTEXT_BUCKETS) -> list[list[int]]:
    """`num` corpus windows whose lengths cycle through `buckets` (deterministic in `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    ids = stream.token_ids
    longest = max(buckets)
    if ids.numel() <= longest:
        raise ProveError(f"corpus of {ids.numel()} tokens is shorter than the longest context ({longest})")
    starts = torch.randint(0, ids.numel() - longest, (num,), generator=gen).tolist()
    return [ids[s : s + buckets[i % len(buckets)]].tolist() for i, s in enumerate(starts)]


@torch.no_grad()
def greedy_continuations(model, contexts: list[list[int]], max_new_tokens: int, eos_id: int,
                         batch_size: int = 128, desc: str | None = None) -> list[list[int]]:
    """Greedy continuation of every context (stopping after EOS), in batches of equal-length
    contexts so no row is padded: what the model writes alone, token for token."""
    model.eval()
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    out: list[list[int] | None] = [None] * len(contexts)
    groups: list[list[int]] = []
    for i in order:
        if groups and len(contexts[groups[-1][0]]) == len(contexts[i]) and len(groups[-1]) < batch_size:
            groups[-1].append(i)
        else:
            groups.append([i])
    for group in tqdm(groups, desc=desc, disable=desc is None, mininterval=2.0):
        ids = torch.tensor([contexts[i] for i in group], dtype=torch.long, device=model.device)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=eos_id, eos_token_id=eos_id)
        for row, i in enumerate(group):
            resp = gen[row, ids.shape[1]:].tolist()
            out[i] = resp[: resp.index(eos_id) + 1] if eos_id in resp else resp
    return out  # type: ignore[return-value]


def build_targets(model, stream: StreamDataset, out_dir: str | Path, *, num_contexts: int, max_new_tokens: int,
                  eos_id: int, seed: int = 0, shard_size: int = 512, batch_size: int = 128,
                  generator_name: str = "", continuations=None) -> list[tuple[list[int], list[int]]]:
    """Write (or resume) the self-distillation dataset in `out_dir`; return its examples.

    `continuations(contexts, max_new_tokens, eos_id)`, if given, writes the continuations in
    place of transformers' `generate` (`vllm_prove.engine.targets.VllmContinuations`: vLLM, the
    engine that serves the result, many times faster on a CPU); `model` still names the writer.

    `meta.json` names the generating checkpoint (`generator_name`, weight fingerprint) and the
    sampling settings; a folder written by another checkpoint or other settings is an error, not
    a silent reuse. Each shard is `shard-NNNNN.json` (`[[context, continuation], ...]`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"generator": generator_name, "fingerprint": fingerprint(model), "num_contexts": num_contexts,
            "max_new_tokens": max_new_tokens, "seed": seed, "shard_size": shard_size,
            "context_buckets": list(CONTEXT_BUCKETS), "decoding": "greedy",
            "engine": "transformers" if continuations is None else type(continuations).__name__}
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
            raise ProveError(f"{out}: holds targets of another generator or settings {diff}; "
                             f"remove the folder or choose another")
    else:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    contexts = sample_contexts(stream, num_contexts, seed)
    examples: list[tuple[list[int], list[int]]] = []
    num_shards = (num_contexts + shard_size - 1) // shard_size
    bar = tqdm(range(num_shards), desc=f"self-distill targets ({generator_name or 'model'})", mininterval=2.0)
    for shard in bar:
        path = out / f"shard-{shard:05d}.json"
        chunk = contexts[shard * shard_size : (shard + 1) * shard_size]
        if path.exists():
            rows = json.loads(path.read_text())
        else:
            written = continuations(chunk, max_new_tokens, eos_id) if continuations is not None else \
                greedy_continuations(model, chunk, max_new_tokens, eos_id, batch_size)
            rows = [[c, r] for c, r in zip(chunk, written)]
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(path)  # a shard exists whole or not at all
        examples.extend((c, r) for c, r in rows)
    return examples


def distill_dataset(examples: list[tuple[list[int], list[int]]], pad_id: int) -> ExampleDataset:
    """Context unsupervised, continuation supervised; a batch holds contexts of one length
    (the contexts come in `CONTEXT_BUCKETS`), cut to its longest example."""
    seq_len = max(len(c) + len(r) for c, r in examples)
    return ExampleDataset(examples, seq_len, pad_id, group_by_prompt=True)


@torch.no_grad()
def greedy_agreement(reference, model, contexts: list[list[int]], max_new_tokens: int, eos_id: int,
                     batch_size: int = 128) -> dict:
    """How often `model`'s greedy output equals `reference`'s (the teacher a lossless user ships):
    share of identical continuations, mean common prefix, and token agreement up to the first
    divergence."""
    a = greedy_continuations(reference, contexts, max_new_tokens, eos_id, batch_size)
    b = greedy_continuations(model, contexts, max_new_tokens, eos_id, batch_size)
    prefixes = [common_prefix_length(x, y) for x, y in zip(a, b)]
    lengths = [max(len(x), 1) for x in a]
    return {"identical": round(sum(x == y for x, y in zip(a, b)) / len(a), 4),
            "mean_common_prefix": round(sum(prefixes) / len(prefixes), 2),
            "common_prefix_share": round(sum(prefixes) / sum(lengths), 4),
            "num_contexts": len(contexts), "max_new_tokens": max_new_tokens}


def self_distill_mars(model, stream: StreamDataset, cfg, *, work_dir: str | Path, mask_token_id: int, eos_id: int,
                      rounds: int = 1, num_contexts: int = 4096, max_new_tokens: int = 64, resume: bool = False,
                      tokenizer=None, name: str = "model", desc: str = "MARS self-distill",
                      evaluate=None, teacher=None, continuations=None) -> list[dict]:
    """MARS training on greedy continuations, `rounds` times, fresh contexts every round
    (seed + round), `cfg.steps` steps each. Who writes the targets:
    - `cfg.anchor == "self"`: the current model (targets refreshed every round);
    - `cfg.anchor == "teacher"`: the frozen starting model, which also anchors the clean copy
      (KL at every position), so the fine-tuned model's greedy output stays the teacher's.
    `cfg.soft_weight` > 0 adds KL to the generator's distribution in the block term.
    `evaluate(model) -> dict`, if given, runs after every round; its result lands in the round's log.
    `teacher`: the frozen starting model when `model` is no longer it (an adapter attached);
    `continuations`: see `build_targets` (only for the teacher's targets: they are written once,
    and its `close()` runs after them).

    Everything lands in `work_dir/round-R/` (`targets/`, `checkpoint/`): with `resume`, finished
    rounds reload their final checkpoint and an interrupted one continues where it stopped.
    """
    import copy

    from vllm_prove.train.trainer import train

    frozen = None
    if cfg.anchor == "teacher":
        frozen = (teacher if teacher is not None else copy.deepcopy(model)).eval().requires_grad_(False)
    elif continuations is not None or teacher is not None:
        raise ProveError("teacher / continuations: only with anchor 'teacher' (the frozen model writes the targets)")
    logs = []
    for r in range(rounds):
        folder = Path(work_dir) / f"round-{r}"
        generator = frozen if frozen is not None else model
        examples = build_targets(generator, stream, folder / "targets", num_contexts=num_contexts,
                                 max_new_tokens=max_new_tokens, eos_id=eos_id, seed=cfg.seed + 1000 * (r + 1),
                                 generator_name=f"{name}@{'teacher' if frozen is not None else f'round{r}'}",
                                 continuations=continuations)
        if continuations is not None and hasattr(continuations, "close"):
            continuations.close()
        teacher = frozen
        if teacher is None and cfg.soft_weight > 0:
            teacher = copy.deepcopy(model).eval().requires_grad_(False)
        log = train(model, distill_dataset(examples, eos_id), cfg, mask_token_id=mask_token_id, out_dir=folder,
                    tokenizer=tokenizer, resume=resume, desc=f"{desc} {r + 1}/{rounds}", teacher=teacher)
        log |= {"round": r, "num_examples": len(examples)}
        if evaluate is not None:
            log["eval"] = evaluate(model)
        logs.append(log)
    return logs
