"""Chunked prefill (max_num_batched_tokens=64) with a 300-token prompt next to
short ones: partial-prefill rows get mask KV written inside their own prompt
range (later overwritten by the next chunk)."""
import sys, json
sys.path.insert(0, "/tmp/proto")
from common import *
if __name__ == "__main__":
    mode = sys.argv[1]
    long_p = open("/work/main/.venv/lib/python3.11/site-packages/vllm/v1/spec_decode/draft_model.py").read()[:1500]
    P = [long_p, "def forward(self, x):", "The scheduler", long_p[200:900]]
    kw = dict(max_model_len=512, max_num_batched_tokens=64, enable_chunked_prefill=True)
    if mode == "prove":
        kw.update(speculative_config={"method": "draft_model", "model": MODEL, "num_speculative_tokens": 6, "parallel_drafting": True},
                  additional_config={"prove": {"mode": "lossless"}})
    llm = make_llm(**kw)
    from vllm import SamplingParams
    outs = llm.generate(P, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), use_tqdm=False)
    print("PROMPT_LENS", [len(o.prompt_token_ids) for o in outs])
    toks = [list(o.outputs[0].token_ids) for o in outs]
    if mode == "ar":
        json.dump(toks, open("/tmp/proto/out_chunk_ar.json", "w"))
    else:
        print("EQUAL_TO_AR", toks == json.load(open("/tmp/proto/out_chunk_ar.json")))
        print("METRICS", spec_metrics(llm))
