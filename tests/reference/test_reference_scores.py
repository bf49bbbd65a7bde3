"""Per-cycle records hold the paper's quantities: q from the verifier, p~ from the mask pass."""

from __future__ import annotations

import torch

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.reference.runner import generate


def test_recorded_scores_match_fresh_forwards(zoo_models, heldout_prompts):
    """Rebuild each cycle's context from the committed tokens and recompute y, p~ and q with
    full, cache-free forwards: the cached decoder must agree (this checks both caches)."""
    cfg = DecodeConfig(method=Method.PROVE, batch_size=3, max_tokens=24, theta=0.05)
    results, _ = generate(cfg, heldout_prompts[:3], zoo_models)
    tok, mask = zoo_models.tokenizer, zoo_models.mask_token_id
    B = cfg.block_size
    for res in results:
        context = tok(res.prompt, add_special_tokens=False)["input_ids"]
        emitted = 0
        for rec in res.records[:4]:
            ctx = context + res.token_ids[:emitted]
            with torch.no_grad():
                p_logits = zoo_models.proposer(input_ids=torch.tensor([ctx + [mask] * (B - 1)])).logits[0, len(ctx) - 1:]
                p, y = torch.softmax(p_logits.float(), -1).max(-1)
                v_logits = zoo_models.verifier(input_ids=torch.tensor([ctx + rec.proposed[:-1]])).logits[0, len(ctx) - 1:]
                q = torch.softmax(v_logits.float(), -1).gather(-1, torch.tensor(rec.proposed)[:, None])[:, 0]
            assert y.tolist() == rec.proposed
            torch.testing.assert_close(torch.tensor(rec.proposer_probs), p, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(rec.verifier_probs), q, atol=1e-5, rtol=1e-4)
            emitted += rec.committed
