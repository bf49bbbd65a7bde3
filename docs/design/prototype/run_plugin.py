import sys, json
sys.path.insert(0, "/tmp/proto")
from common import *
from run_baseline import inspect
if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "lossless":
        kw = dict(speculative_config={"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4, "parallel_drafting": True},
                  additional_config={"prove": {"mode": "lossless"}})
    else:
        kw = dict(speculative_config={"model": "prove_proto.gate.MaskBlockProposer", "num_speculative_tokens": 7},
                  additional_config={"prove": {"mode": "mars", "tau": 0.3}}, max_model_len=256)
    llm = make_llm(**kw)
    i = llm.collective_rpc(inspect)[0]
    print("INFO", i["runner"], i["drafter"], i["shared_model"], i["num_blocks"])
    outs = greedy(llm, n=48 if mode == "lossless" else 64)
    if mode == "lossless":
        print("EQUAL_TO_AR", outs == json.load(open("/tmp/proto/out_ar.json")))
    else:
        from vllm import SamplingParams
        o2 = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        json.dump([dict(prompt=list(o.prompt_token_ids), out=list(o.outputs[0].token_ids)) for o in o2], open("/tmp/proto/out_gate_mars.json", "w"))
    print("METRICS", spec_metrics(llm))
