import os
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/proto/.vllm_cache")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/proto/.inductor")
MODEL = "/tmp/proto/tiny_qwen2"
VERIFIER = "/tmp/proto/tiny_qwen2_verifier"
PROMPTS = ["def forward(self, x):", "import torch\nimport numpy as np\n", "The scheduler", "class Foo:\n    def __init__(self"]

def make_llm(**kw):
    from vllm import LLM
    args = dict(model=MODEL, dtype="float32", enforce_eager=True, max_model_len=512,
                max_num_seqs=8, seed=0, disable_log_stats=False)
    args.update(kw)
    return LLM(**args)

def greedy(llm, n=48, prompts=PROMPTS, **sp):
    from vllm import SamplingParams
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **sp)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]

def spec_metrics(llm):
    out = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            out[m.name] = getattr(m, "values", None) if hasattr(m, "values") else getattr(m, "value", None)
    return out
