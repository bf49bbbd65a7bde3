"""The zoo's training text: the Python standard library of the running interpreter.

Real text that none of us wrote, present on every machine that runs the project, and split
train / held-out *by file*, deterministically (a file's split depends only on its path), so a
held-out prompt never shares a file with training text.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from vllm_prove.errors import ProveError

# Folders left out: test suites (huge, repetitive fixtures), IDLE, and installed packages.
_EXCLUDED_PARTS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
HELDOUT_PERCENT = 10  # share of files (by path hash) kept out of training


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    text: str

    @property
    def heldout(self) -> bool:
        digest = hashlib.sha256(self.relpath.encode()).digest()
        return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(root: Path | None = None) -> list[CorpusFile]:
    """All `.py` files under the stdlib, sorted by relative path (the order is part of the hash)."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            files.append(CorpusFile(rel.as_posix(), text))
    if not files:
        raise ProveError(f"no Python source found under {root}")
    return files


def corpus_hash(files: list[CorpusFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    train = [f for f in files if not f.heldout]
    heldout = [f for f in files if f.heldout]
    return train, heldout


def corpus_info(files: list[CorpusFile]) -> dict:
    train, heldout = split(files)
    return {
        "source": "python-stdlib",
        "python_version": sys.version.split()[0],
        "num_files": len(files),
        "num_train_files": len(train),
        "num_heldout_files": len(heldout),
        "num_chars": sum(len(f.text) for f in files),
        "sha256": corpus_hash(files),
    }


def heldout_prompts(heldout: list[CorpusFile], n: int, seed: int = 0) -> list[dict]:
    """`n` prompts of mixed lengths (1-12 lines) cut from held-out files at line starts."""
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        f = rng.choice(heldout)
        lines = f.text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        num_lines = rng.choice([1, 2, 3, 5, 8, 12])
        start = rng.randrange(0, len(lines) - num_lines)
        text = "".join(lines[start : start + num_lines])
        if len(text.strip()) < 8 or len(text) > 600:
            continue
        prompts.append({"prompt": text, "source": f"{f.relpath}:{start + 1}"})
    return prompts


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
