"""Self-distillation targets written by vLLM: the greedy continuations a training recipe learns
(`vllm_prove/train/distill.py`), from the engine the trained model is served by.

`VllmContinuations(model)` is the `continuations` callable of `build_targets`: contexts (token
ids) in, greedy continuations (stopping after EOS, EOS kept) out. The engine starts at the first
call and `close()` shuts it down, so training does not share the machine with an idle engine.
"""

from __future__ import annotations

import contextlib


class VllmContinuations:
    def __init__(self, model: str, dtype: str = "float32", max_num_seqs: int = 64):
        self.kwargs = {"model": model, "dtype": dtype, "enforce_eager": True, "seed": 0,
                       "max_num_seqs": max_num_seqs}
        self._stack: contextlib.ExitStack | None = None
        self._llm = None

    def __call__(self, contexts: list[list[int]], max_new_tokens: int, eos_id: int) -> list[list[int]]:
        from vllm import SamplingParams

        from vllm_prove.engine.generate import engine

        if self._llm is None:
            self._stack = contextlib.ExitStack()
            self._llm = self._stack.enter_context(engine(self.kwargs))
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=[eos_id])
        outputs = self._llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
        out = []
        for o in outputs:
            resp = list(o.outputs[0].token_ids)
            out.append(resp[: resp.index(eos_id) + 1] if eos_id in resp else resp)
        return out

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self._llm = None, None
