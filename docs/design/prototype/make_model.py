import os, glob, json, torch
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

def corpus():
    files = glob.glob("/work/main/.venv/lib/python3.11/site-packages/vllm/v1/**/*.py", recursive=True)[:300]
    for f in files:
        yield open(f, errors="ignore").read()

def build(out, vocab=4096, hidden=128, layers=2, heads=2, seed=0):
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab - 2, special_tokens=[],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), tr)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": ["<|mask|>"]})
    fast.save_pretrained(out)
    eos = fast.convert_tokens_to_ids("<|endoftext|>"); mask = fast.convert_tokens_to_ids("<|mask|>")
    assert len(fast) <= vocab, len(fast)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4*hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=hidden//heads, max_position_embeddings=2048, tie_word_embeddings=False,
                      eos_token_id=eos, bos_token_id=eos, torch_dtype="float32")
    m = Qwen2ForCausalLM(cfg)
    # make the random model a bit peaky so greedy is non-trivial but deterministic
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    m.save_pretrained(out, safe_serialization=True)
    c = json.load(open(f"{out}/config.json")); c["mask_token_id"] = mask
    json.dump(c, open(f"{out}/config.json", "w"), indent=2)
    print(out, "eos", eos, "mask", mask, "len tok", len(fast), sum(p.numel() for p in m.parameters()))

if __name__ == "__main__":
    build("/tmp/proto/tiny_qwen2")
    build("/tmp/proto/tiny_qwen2_verifier", hidden=64, layers=1, heads=1, seed=1)
