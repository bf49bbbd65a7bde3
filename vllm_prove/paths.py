"""Where the embedded tiny model zoo lives, for every layer that defaults to it (the zoo package
builds it; the decoders, the engine and the evaluation only read it).

`VLLM_PROVE_ZOO_DIR` points the whole project at another zoo folder (e.g. a `--scale smoke` build).
"""

import os
from pathlib import Path

ZOO_DIR = Path(os.environ.get("VLLM_PROVE_ZOO_DIR") or Path(__file__).resolve().parent / "zoo" / "models")
HELDOUT_PROMPTS = ZOO_DIR / "heldout_prompts.jsonl"


def zoo_path(role: str) -> str:
    """The zoo's ``proposer``, ``verifier`` or ``drafter`` folder."""
    return str(ZOO_DIR / role)
