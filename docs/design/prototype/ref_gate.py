"""HF-transformers reference of the lossy/MARS cycle (no KV cache: every window
pass recomputes committed context as real tokens), incl. vLLM's first AR step."""
import sys, json, torch
from transformers import AutoModelForCausalLM
sys.path.insert(0, "/tmp/proto")
from common import MODEL, VERIFIER

@torch.no_grad()
def run(prompt, n, mode, thr, B, tgt, ver, mask):
    ctx = list(prompt)
    ctx.append(int(tgt(torch.tensor([ctx])).logits[0, -1].argmax()))   # prefill step: 1 AR token
    margins = []
    while len(ctx) - len(prompt) < n:
        inp = torch.tensor([ctx + [mask] * (B - 1)])
        lg = tgt(inp).logits[0, -B:].float()
        p, y = torch.softmax(lg, -1).max(-1)
        if mode == "verifier":
            vl = ver(torch.tensor([ctx + y[:B - 1].tolist()])).logits[0, -B:].float()
            s = p * torch.softmax(vl, -1).gather(1, y[:, None]).squeeze(1)
        else:
            s = p
        a = 1
        while a < B and s[a] >= thr:
            a += 1
        if a < B: margins.append(float(abs(s[a] - thr) / thr))
        ctx += y[:a].tolist()
    return ctx[len(prompt):len(prompt) + n], min(margins) if margins else None

if __name__ == "__main__":
    mode, thr = sys.argv[1], float(sys.argv[2]); B = 8
    tgt = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ver = AutoModelForCausalLM.from_pretrained(VERIFIER, dtype=torch.float32).eval()
    mask = json.load(open(MODEL + "/config.json"))["mask_token_id"]
    res = json.load(open(f"/tmp/proto/out_gate_{mode}.json"))
    for r in res:
        ref, m = run(r["prompt"], len(r["out"]), mode, thr, B, tgt, ver, mask)
        same = ref == r["out"]
        d = None if same else next(i for i in range(len(ref)) if ref[i] != r["out"][i])
        print("MATCH", same, "first_diff", d, "min_rel_margin", m)
