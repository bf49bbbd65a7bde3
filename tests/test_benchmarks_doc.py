"""docs/BENCHMARKS.md is generated from docs/data/*.json, names no history of its own making, and
links only plots that exist. Pure text: no engine, no model."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
SCRIPT = ROOT / "scripts" / "benchmarks_md.py"
HISTORY = re.compile(r"session [0-9]|sessions [0-9]|bench[0-9]{2}", re.IGNORECASE)


def load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_md", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_file_is_the_rendering_of_the_committed_data():
    assert DOC.read_text() == load_script().render(), (
        "docs/BENCHMARKS.md differs from docs/data/*.json: edit the JSON and run "
        "`python scripts/benchmarks_md.py` (`--check` shows the diff)"
    )


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_names_sessions_or_numbered_runs():
    hits = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the working tree
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "text that refers to the history of its own making (sessions, numbered runs):\n" + "\n".join(hits)


def test_every_linked_plot_exists():
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", DOC.read_text())
    assert links, "BENCHMARKS.md links no plot"
    missing = [link for link in links if not (DOC.parent / link).is_file()]
    assert not missing, f"plots linked from docs/BENCHMARKS.md that do not exist: {missing}"
