"""Imports flow one way (the import-linter contract in pyproject.toml), and no module reaches
into another's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_prove"


def test_the_layer_contract_holds():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_no_private_name_is_imported_across_modules():
    """`from vllm_prove.x import _name` couples a module to another's internals: what is shared
    gets a public name where it lives."""
    crossings = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_prove"):
                crossings += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}"
                              for alias in node.names if alias.name.startswith("_") and alias.name != "__version__"]
    assert not crossings, crossings
