"""`vllm-prove eval`: tasks x methods, generated on Ray (or in-process), scored, reported.

Resumable: every (method, task) is cut into shards of ``shard_size`` items; a shard is
written to ``OUT/shards/METHOD/TASK/NNNN.jsonl`` (atomically) once all of its rows came back,
and a finished shard is never generated again. ``OUT/shards/METHOD/settings.json`` holds the
engine settings the shards were made with; a resume with other settings stops with an error
instead of mixing them. Scoring and the report are recomputed from the shards on every run.

Methods are ``NAME[:field=value...]`` over ``DecodeConfig`` (``prove:theta=0.05``,
``prove-lossless:block_size=16``), validated by pydantic; at several concurrencies each
method runs once per concurrency and is labelled ``LABEL@cN``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_prove.config import DecodeConfig, Method
from vllm_prove.errors import ProveError
from vllm_prove.eval import ray_eval
from vllm_prove.eval.tasks import Task, load_task, parse_task_names


class EvalConfig(BaseModel):
    """One `vllm-prove eval` run (a preset's ``eval`` section has these fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: list[str] = Field(min_length=1)
    """humaneval, heldout, FILE.jsonl, lm-eval:NAME (vllm_prove/eval/tasks.py)."""
    methods: list[str] = Field(min_length=1)
    """NAME[:field=value...]: ar, sd, mars, prove, prove-lossless with DecodeConfig overrides."""
    limit: int | None = Field(None, ge=1)
    """First N items of every task."""
    ray: bool = False
    """Generate on Ray Data engine actors (else in-process, same batches)."""
    address: str | None = None
    """Ray cluster address (default: start a local cluster)."""
    replicas: int = Field(1, ge=1, le=1024)
    """Engine actors per method (Ray)."""
    concurrency: list[int] = Field([1], min_length=1)
    """Requests in flight per engine; several values = a concurrency sweep."""
    batch_size: int | None = Field(None, ge=1, le=100_000)
    """Rows per engine batch; None = enough batches for every replica, at least `concurrency`."""
    shard_size: int = Field(16, ge=1, le=100_000)
    """Items per shard on disk (the unit of resumption)."""
    decode: dict = Field(default_factory=dict)
    """DecodeConfig fields shared by every method (a preset's `decode` section)."""
    lm_eval_include: str | None = None
    """Folder of extra lm-eval task YAMLs."""
    out: str
    """Output folder."""

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(c < 1 or c > 4096 for c in values):
            raise ValueError(f"every concurrency must be in [1, 4096], got {values}")
        return values


@dataclass(frozen=True)
class MethodRun:
    label: str
    cfg: DecodeConfig
    concurrency: int


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_methods(specs: list[str], decode: dict, concurrency: list[int]) -> list[MethodRun]:
    """``NAME[:field=value...]`` -> validated configurations, AR first when present."""
    runs = []
    for spec in specs:
        name, *fields = spec.split(":")
        try:
            method = Method(name)
        except ValueError:
            known = [m.value for m in Method if not m.diffusion]
            raise ProveError(f"--methods: unknown method {name!r}; choose from {known}") from None
        overrides = {}
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep:
                raise ProveError(f"--methods {spec!r}: expected field=value after ':', got {item!r}")
            overrides[key.replace("-", "_")] = _value(value)
        cfg = DecodeConfig(**{**decode, **overrides, "method": method})
        for c in concurrency:
            runs.append(MethodRun(spec if len(concurrency) == 1 else f"{spec}@c{c}", cfg, c))
    if len({r.label for r in runs}) != len(runs):
        raise ProveError(f"--methods: a method is named twice: {specs}")
    return sorted(runs, key=lambda r: r.cfg.method is not Method.AR)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=@-]+", "_", name)


class ShardStore:
    """Finished shards of one output folder."""

    def __init__(self, root: Path, shard_size: int):
        self.root, self.shard_size = root, shard_size

    def path(self, label: str, task: str, shard: int) -> Path:
        return self.root / _safe(label) / _safe(task) / f"{shard:04d}.jsonl"

    def check_settings(self, label: str, settings: dict) -> None:
        path = self.root / _safe(label) / "settings.json"
        if path.exists():
            if json.loads(path.read_text()) != settings:
                raise ProveError(f"{path}: shards of {label!r} were made with other settings; use another --out "
                                 "or delete that folder")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")

    def done(self, label: str, task: str, shard: int, size: int) -> bool:
        """Whether the shard is on disk with at least its ``size`` rows (a run with a smaller
        --limit may have written a shorter last shard; a larger one, a longer one)."""
        path = self.path(label, task, shard)
        return path.exists() and len(path.read_text().splitlines()) >= size

    def write(self, label: str, task: str, shard: int, records: list[dict]) -> None:
        path = self.path(label, task, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["index"])))
        os.replace(tmp, path)

    def load(self, label: str, task: Task) -> list[dict]:
        records = []
        for shard in range(_num_shards(len(task.items), self.shard_size)):
            path = self.path(label, task.name, shard)
            records += [json.loads(line) for line in path.read_text().splitlines()]
        return [r for r in records if r["index"] < len(task.items)]


def _num_shards(num_items: int, shard_size: int) -> int:
    return (num_items + shard_size - 1) // shard_size


def _rows(task: Task, shard: int, shard_size: int) -> list[dict]:
    items = task.items[shard * shard_size: (shard + 1) * shard_size]
    return [{"task": task.name, "index": shard * shard_size + i, "prompt": item.prompt,
             "sampling": json.dumps({"temperature": 0.0, "max_tokens": item.max_tokens,
                                     **({"stop": list(item.stop)} if item.stop else {})})}
            for i, item in enumerate(items)]


def run_eval(cfg: EvalConfig, log=print, progress=None) -> dict:
    """Generate what is missing, score everything, write the report; returns it."""
    from tqdm import tqdm

    from vllm_prove.engine.generate import prepare_environment
    from vllm_prove.eval import report as report_mod

    prepare_environment()
    tasks = [load_task(n, cfg.limit, cfg.lm_eval_include) for n in parse_task_names(cfg.tasks)]
    if len({t.name for t in tasks}) != len(tasks):
        raise ProveError(f"--tasks: a task is named twice: {[t.name for t in tasks]}")
    runs = parse_methods(cfg.methods, cfg.decode, cfg.concurrency)
    out = Path(cfg.out)
    store = ShardStore(out / "shards", cfg.shard_size)
    total = sum(len(t.items) for t in tasks) * len(runs)
    bar = tqdm(total=total, desc="eval", unit="row", file=progress, disable=progress is None, dynamic_ncols=True)
    for run in runs:
        store.check_settings(run.label, {"engine_kwargs": ray_eval.engine_settings(run.cfg, run.concurrency),
                                         "concurrency": run.concurrency})
        todo, pending = [], {}
        for task in tasks:
            for shard in range(_num_shards(len(task.items), cfg.shard_size)):
                rows = _rows(task, shard, cfg.shard_size)
                if store.done(run.label, task.name, shard, len(rows)):
                    bar.update(len(rows))
                else:
                    todo += rows
                    pending[(task.name, shard)] = (len(rows), [])
        if not todo:
            log(f"{run.label}: every shard is on disk, nothing to generate")
            continue
        bar.set_postfix_str(run.label)

        def on_record(record: dict, run=run) -> None:
            key = (record["task"], record["index"] // cfg.shard_size)
            size, got = pending[key]
            got.append(record)
            bar.update()
            if len(got) == size:
                store.write(run.label, *key, got)

        batch_size = cfg.batch_size or _batch_size(len(todo), cfg.replicas if cfg.ray else 1, run.concurrency)
        log(f"{run.label}: {len(todo)} rows in {len(pending)} shards, batches of {batch_size}, "
            f"{run.concurrency} in flight per engine" + (f", {cfg.replicas} Ray engine actors" if cfg.ray else ""))
        if cfg.ray:
            ray_eval.connect(cfg.address, cfg.replicas)
            ray_eval.generate_ray(run.cfg, todo, replicas=cfg.replicas, concurrency=run.concurrency,
                                  batch_size=batch_size, on_record=on_record)
        else:
            ray_eval.generate_local(run.cfg, todo, concurrency=run.concurrency, batch_size=batch_size,
                                    on_record=on_record)
        missing = [key for key, (size, got) in pending.items() if len(got) != size]
        if missing:
            raise RuntimeError(f"{run.label}: the engines returned no rows for shards {missing}")
    bar.close()
    records = {run.label: {t.name: store.load(run.label, t) for t in tasks} for run in runs}
    report = report_mod.build_report(tasks, runs, records)
    report_mod.write(report, out, runs, cfg.model_dump())
    return report


def _batch_size(num_rows: int, engines: int, concurrency: int) -> int:
    """At least ``concurrency`` rows (a full engine) and about 4 batches per engine (work for
    every replica, little tail), at most 64."""
    return max(concurrency, min(64, -(-num_rows // (4 * engines))))
