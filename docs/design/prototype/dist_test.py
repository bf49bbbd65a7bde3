"""Empirical exactness of lossless sampling: marginal of the 2nd and 3rd generated
token vs the exact proposer distribution (computed with HF)."""
import sys, json, collections
sys.path.insert(0, "/tmp/proto")
from common import *
PROMPT = "def forward(self, x):"
N = 4000; T = 1.0

def exact():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        p1 = torch.softmax(m(torch.tensor([ids])).logits[0, -1] / T, -1)
        sup = torch.nonzero(p1 > 1e-7).squeeze(1)
        x = torch.tensor([ids + [int(t)] for t in sup])
        p2c = torch.softmax(m(x).logits[:, -1] / T, -1)
        p2 = (p1[sup, None] * p2c).sum(0)
    return ids, p1, p2

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "exact":
        import torch
        ids, p1, p2 = exact()
        torch.save(dict(ids=ids, p1=p1, p2=p2), "/tmp/proto/exact.pt"); print("support", int((p1 > 1e-7).sum())); sys.exit()
    if mode == "ar":
        llm = make_llm(max_num_seqs=256)
    else:
        llm = make_llm(max_num_seqs=256, worker_cls="prove_proto.worker.ProveCPUWorker",
                       speculative_config={"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4,
                                           "parallel_drafting": True, "draft_sample_method": "probabilistic"},
                       additional_config={"prove": {"mode": "lossless", "fix_cpu_expand": mode == "fix"}})
    from vllm import SamplingParams
    outs = llm.generate([PROMPT] * N, SamplingParams(temperature=T, max_tokens=3, ignore_eos=True), use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    json.dump(toks, open(f"/tmp/proto/dist_{mode}.json", "w"))
    print("METRICS", spec_metrics(llm))
