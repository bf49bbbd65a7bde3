import sys, json
sys.path.insert(0, "/tmp/proto")
from common import *
if __name__ == "__main__":
    llm = make_llm(speculative_config={"model": "prove_proto.gate.MaskBlockProposer", "num_speculative_tokens": 7},
                   additional_config={"prove": {"mode": "mars", "tau": 0.3}}, max_model_len=128)
    from vllm import SamplingParams
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
    print("LENS", [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs], [o.outputs[0].finish_reason for o in outs])
    print("ZERO_TOKENS", sum(t == 0 for o in outs for t in o.outputs[0].token_ids))
    print("METRICS", spec_metrics(llm))
