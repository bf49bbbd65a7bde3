import sys, json, time
sys.path.insert(0, "/tmp/proto")
from common import *
from run_baseline import inspect

def kv_probe(self):
    """count drafter steps inside the worker"""
    d = self.model_runner.drafter
    return dict(steps=getattr(d, "stats_steps", None))

if __name__ == "__main__":
    K = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    t = time.time()
    llm = make_llm(worker_cls="prove_proto.worker.ProveCPUWorker",
                   speculative_config={"method": "draft_model", "model": MODEL,
                                       "num_speculative_tokens": K, "parallel_drafting": True},
                   additional_config={"prove": {"mode": "lossless"}})
    print("startup", time.time() - t)
    print(json.dumps(llm.collective_rpc(inspect)[0], indent=1))
    t = time.time()
    outs = greedy(llm)
    print("gen", time.time() - t)
    ref = json.load(open("/tmp/proto/out_ar.json"))
    print("EQUAL_TO_AR", outs == ref)
    for a, b in zip(outs, ref):
        if a != b:
            i = next(i for i in range(len(a)) if a[i] != b[i]); print("first diff at", i, a[i-2:i+3], b[i-2:i+3])
    print(spec_metrics(llm))
    print(llm.collective_rpc(kv_probe))
