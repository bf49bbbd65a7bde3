"""Helpers shared by the eval tests (imported by name, as tests/engine/engine_support.py)."""

from __future__ import annotations

import json
from pathlib import Path


def write_lm_eval_task(folder: Path, name: str, rows: list[dict], until: list[str], max_gen_toks: int) -> Path:
    """A local lm-eval generate_until task (``dataset_path: json``, no download): each row's
    ``prompt`` is the context, its ``target`` the exact_match reference. Returns the folder."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: {json.dumps(until)}
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return folder
