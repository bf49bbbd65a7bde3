"""Prompt files: `.jsonl` with a `prompt` field (other fields ignored) or `.txt`, one per line."""

from __future__ import annotations

import json
from pathlib import Path
from vllm_prove.errors import ProveError


def read_prompts(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.exists():
        raise ProveError(f"--prompts: no such file {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ProveError(f"--prompts {path}:{n}: each line needs a string `prompt` field")
            prompts.append(row["prompt"])
    elif path.suffix == ".txt":
        prompts = [line for line in lines if line.strip()]
    else:
        raise ProveError(f"--prompts {path}: expected a .jsonl or .txt file")
    if not prompts:
        raise ProveError(f"--prompts {path}: no prompts found")
    return prompts
