"""A zoo proposer's quality as a language model: held-out CE and top-1 accuracy (8 x 8 corpus
windows of 256 tokens) and the share of distinct 4-grams in its greedy continuations of the
zoo's held-out prompts (48 tokens each; a looping model scores low).

    python scripts/proposer_quality.py [ZOO_DIR]
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_prove.prompts import read_prompts
from vllm_prove.train.data import StreamDataset, encode_stream
from vllm_prove.train.distill import greedy_continuations
from vllm_prove.zoo import ZOO_DIR
from vllm_prove.zoo import corpus as corpus_mod


@torch.no_grad()
def main(zoo: str) -> dict:
    tok = AutoTokenizer.from_pretrained(f"{zoo}/proposer")
    model = AutoModelForCausalLM.from_pretrained(f"{zoo}/proposer", dtype=torch.float32).eval()
    _, heldout = corpus_mod.split(corpus_mod.load_corpus())
    stream = StreamDataset(encode_stream(tok, [f.text for f in heldout]), 256)
    gen, ce, top1 = torch.Generator().manual_seed(1234), 0.0, 0.0
    for _ in range(8):
        ids = stream.sample(8, gen).input_ids  # [8, 256]
        logits = model(input_ids=ids).logits[:, :-1]  # [8, 255, vocab]
        ce += torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item() / 8
        top1 += (logits.argmax(-1) == ids[:, 1:]).float().mean().item() / 8
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in read_prompts(f"{zoo}/heldout_prompts.jsonl")]
    outs = greedy_continuations(model, prompts, 48, tok.eos_token_id, batch_size=1)
    grams = [tuple(o[i : i + 4]) for o in outs for i in range(len(o) - 3)]
    return {"zoo": str(zoo), "heldout_ce": round(ce, 3), "top1": round(top1, 3),
            "distinct4": round(len(set(grams)) / max(1, len(grams)), 3)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else str(ZOO_DIR))))
