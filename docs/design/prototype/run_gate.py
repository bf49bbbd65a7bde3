import os, sys, json, time, collections
sys.path.insert(0, "/tmp/proto")
from common import *
from run_baseline import inspect

def alog(self):
    c = collections.Counter(getattr(self.model_runner, "_prove_log", []))
    return [[int(k), int(v)] for k, v in sorted(c.items())]

if __name__ == "__main__":
    mode, thr = sys.argv[1], float(sys.argv[2]); B = 8
    if mode == "verifier":
        spec = {"method": "draft_model", "model": VERIFIER, "num_speculative_tokens": B - 1}
        pc = {"mode": "verifier", "theta": thr}
    else:
        spec = {"model": "prove_proto.gate.MaskBlockProposer", "num_speculative_tokens": B - 1}
        pc = {"mode": "mars", "tau": thr}
    llm = make_llm(worker_cls="prove_proto.worker.ProveCPUWorker",
                   scheduler_cls=None if os.environ.get("NO_ROLLBACK") else "prove_proto.scheduler.ProveScheduler",
                   speculative_config=spec, additional_config={"prove": pc}, max_model_len=256)
    info = llm.collective_rpc(inspect)[0]
    print("INFO", info["runner"], info["drafter"], info["groups"], info["drafter_params"])
    from vllm import SamplingParams
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    res = [dict(prompt=list(o.prompt_token_ids), out=list(o.outputs[0].token_ids)) for o in outs]
    json.dump(res, open(f"/tmp/proto/out_gate_{mode}.json", "w"))
    print("LENS", [len(r["out"]) for r in res])
    print("A_HIST", llm.collective_rpc(alog)[0])
    print("METRICS", spec_metrics(llm))
