"""Stress: K=8, 8 prompts (shared prefixes -> prefix caching), long outputs that
cross the 128-token KV block and run into max_model_len; then temperature>0 with
mask-pass draft probabilities."""
import sys, json, time
sys.path.insert(0, "/tmp/proto")
from common import *

P = ["def forward(self, x):", "def forward(self, x, y):", "import torch\nimport numpy as np\n",
     "The scheduler", "class Foo:\n    def __init__(self", "# SPDX-License-Identifier: Apache-2.0\n",
     "# SPDX-License-Identifier: Apache-2.0\nimport os", "x"]

def wrap_rs(self):
    r = self.model_runner
    rs = r.rejection_sampler
    rs._seen = []
    orig = rs.forward
    def fwd(metadata, draft_probs, logits, sampling_metadata):
        rs._seen.append(None if draft_probs is None else tuple(draft_probs.shape))
        return orig(metadata, draft_probs, logits, sampling_metadata)
    rs.forward = fwd
    return True

def seen(self):
    s = self.model_runner.rejection_sampler._seen
    return dict(calls=len(s), with_probs=sum(x is not None for x in s), example=next((x for x in s if x), None))

if __name__ == "__main__":
    mode = sys.argv[1]; K = 8
    kw = dict(max_model_len=256)
    if mode == "ar":
        llm = make_llm(**kw)
    else:
        llm = make_llm(worker_cls="prove_proto.worker.ProveCPUWorker",
                       speculative_config={"method": "draft_model", "model": MODEL,
                                           "num_speculative_tokens": K, "parallel_drafting": True,
                                           "draft_sample_method": "probabilistic"},
                       additional_config={"prove": {"mode": "lossless"}}, **kw)
        llm.collective_rpc(wrap_rs)
    from vllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)   # capped by max_model_len
    t = time.time()
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(P, sp, use_tqdm=False)]
    print("gen", time.time() - t, [len(o) for o in outs])
    if mode == "ar":
        json.dump(outs, open("/tmp/proto/out_ar2.json", "w"))
    else:
        ref = json.load(open("/tmp/proto/out_ar2.json"))
        print("EQUAL_TO_AR", outs == ref, sum(a == b for a, b in zip(outs, ref)), "/", len(ref))
        print("greedy metrics", spec_metrics(llm))
        print("greedy rs", llm.collective_rpc(seen))
        llm.collective_rpc(wrap_rs)
        sp = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True, seed=None)
        outs = llm.generate(P, sp, use_tqdm=False)
        print("sampled lens", [len(o.outputs[0].token_ids) for o in outs])
        print("sampled metrics", spec_metrics(llm))
        print("sampled rs", llm.collective_rpc(seen))
