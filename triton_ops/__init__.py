"""Triton kernels for the acceptance math (GPU path); their torch twins live in
``vllm_prove.core.fused``, which dispatches by device and imports these modules lazily.

- ``vocab_reductions``: top-1 confidence and token probability, one pass over the logits.
- ``block_gates``: product gate and lossless compare over vLLM's ragged draft layout.
- ``feasible_prefix``: the verifier-skipping feasible prefix ``K^``.

Nothing is imported here: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is
imported, so importing a submodule is the moment that decides compiled vs interpreted.
"""
