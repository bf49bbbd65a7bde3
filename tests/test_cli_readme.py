"""The README's CLI block and the parser agree: every flag the README shows exists on its
subcommand, and every flag of every subcommand is shown (a flag the README leaves out is a flag
no user finds)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vllm_prove.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_SHOWN = {"-h", "--help"}


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[str] | None]:
    """Each leaf subcommand (as its words) with its option strings (argparse keeps them in
    ``_actions``: it has no public walk)."""
    out = {}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        if any(a.nargs == argparse.REMAINDER for a in parser._actions):
            return {prefix: None}  # (passes its arguments through: `serve` to vllm, `lm-eval` to lm-eval)
        return {prefix: {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - NOT_SHOWN}
    for name, child in subs[0].choices.items():
        out |= commands(child, (*prefix, name))
    return out


def readme_block() -> list[str]:
    """The README's `## CLI` code block, continuation lines joined to their command."""
    text = README.read_text()
    block = text.split("## CLI", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = []
    for line in block.splitlines():
        if line.startswith("vllm-prove "):
            lines.append(line)
        elif line.startswith(" ") and lines and not line.strip().startswith("#"):
            lines[-1] += " " + line.strip()
    return lines


def test_the_readme_cli_block_shows_every_subcommand_and_flag_the_parser_has():
    parsed = commands(build_parser())
    shown: dict[tuple[str, ...], set[str]] = {}
    for line in readme_block():
        for part in line.split(" | "):  # (several commands on one line)
            words = part.split("#", 1)[0].split()
            if not words or words[0] != "vllm-prove":
                continue
            key = next(k for k in sorted(parsed, key=len, reverse=True) if tuple(words[1:1 + len(k)]) == k)
            flags = shown.setdefault(key, set())
            flags.update(re.findall(r"--[a-z0-9][a-z0-9-]*", part.split("#", 1)[0]))
            for other in re.findall(r"\[the flags of ([a-z-]+)\]", part):  # (one subcommand's flags are another's)
                flags.update(parsed[(other,)])
    assert not set(parsed) - set(shown), f"subcommands missing from the README: {sorted(set(parsed) - set(shown))}"
    shown = {k: v for k, v in shown.items() if parsed[k] is not None}
    unknown = {k: sorted(v - parsed[k]) for k, v in shown.items() if v - parsed[k]}
    assert not unknown, f"flags the README shows that the parser does not have: {unknown}"
    missing = {k: sorted(parsed[k] - v) for k, v in shown.items() if parsed[k] - v}
    assert not missing, f"flags the parser has that the README's CLI block leaves out: {missing}"
