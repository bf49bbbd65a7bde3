"""The tiny model zoo: a proposer, a verifier and a diffusion drafter trained by `vllm-prove zoo
build` (the folder itself: `vllm_prove.paths`)."""

from vllm_prove.paths import HELDOUT_PROMPTS, ZOO_DIR

__all__ = ["HELDOUT_PROMPTS", "ZOO_DIR"]
