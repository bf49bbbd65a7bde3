import sys, json, time
sys.path.insert(0, "/tmp/proto")
from common import *

def inspect(self):
    r = self.model_runner
    cfg = r.kv_cache_config
    layers = [n for g in cfg.kv_cache_groups for n in g.layer_names]
    nparams = sum(p.numel() for p in r.model.parameters())
    d = getattr(r, "drafter", None)
    dparams = sum(p.numel() for p in d.model.parameters()) if d is not None and hasattr(d, "model") else 0
    same = d is not None and getattr(d, "model", None) is r.model
    groups=[(type(g.kv_cache_spec).__name__, list(g.layer_names)) for g in cfg.kv_cache_groups]
    return dict(groups=groups, layers=layers, n_kv_tensors=len(cfg.kv_cache_tensors), num_blocks=cfg.num_blocks,
                runner=type(r).__name__, drafter=type(d).__name__ if d else None,
                target_params=nparams, drafter_params=dparams, shared_model=same,
                attn_backend=[type(g.backend).__name__ if not isinstance(g.backend, type) else g.backend.__name__ for gs in r.attn_groups for g in gs])

if __name__ == "__main__":
    mode = sys.argv[1]
    t = time.time()
    if mode == "ar":
        llm = make_llm()
    elif mode == "selfpard":
        llm = make_llm(speculative_config={"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4, "parallel_drafting": True})
    elif mode == "draft":
        llm = make_llm(speculative_config={"method": "draft_model", "model": VERIFIER, "num_speculative_tokens": 3})
    print("startup", time.time() - t)
    print(json.dumps(llm.collective_rpc(inspect)[0], indent=1))
    t = time.time()
    outs = greedy(llm)
    print("gen", time.time() - t)
    json.dump(outs, open(f"/tmp/proto/out_{mode}.json", "w"))
    print([o[:12] for o in outs])
    print(spec_metrics(llm))
