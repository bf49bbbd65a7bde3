"""The tiny model zoo: a proposer and a verifier trained by `vllm-prove zoo build`.

`VLLM_PROVE_ZOO_DIR` points the whole project at another zoo folder (e.g. a `--scale smoke` build).
"""

import os
from pathlib import Path

ZOO_DIR = Path(os.environ.get("VLLM_PROVE_ZOO_DIR") or Path(__file__).resolve().parent / "models")
HELDOUT_PROMPTS = ZOO_DIR / "heldout_prompts.jsonl"
