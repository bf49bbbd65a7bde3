"""Scores, speed and plots of `vllm-prove eval` from the stored records.

``report.json``: ``{task: {method: {"pass@1" | "accuracy" | "agreement": x, "ci95": [lo, hi],
"delta_vs_ar", "delta_ci95", "tokens_per_s", "num_tokens", "seconds", "committed_per_cycle",
"acceptance_per_position", "committed_histogram", "engines", ...}}}``.

Speed (methods.md §8): tokens over in-flight seconds of the engines themselves. Within each
engine batch the busy time is split among the requests in flight (``scoring.attributed_seconds``),
so a task's seconds are its requests' shares and the shares of all tasks add up to the engines'
in-flight time. Spec-decode counters are counted per batch; a batch holding several tasks gives
each a share of them in proportion to its tokens (exact for single-task batches, which is every
batch but those at a task boundary, as rows go to the engines task by task).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from vllm_prove.config import Method
from vllm_prove.core.metrics import common_prefix_length
from vllm_prove.eval import scoring
from vllm_prove.eval.tasks import Task


def _ar_label(runs, run) -> str | None:
    """The AR run at the same concurrency (the baseline of deltas, speedups and agreement)."""
    return next((r.label for r in runs if r.cfg.method is Method.AR and r.concurrency == run.concurrency), None)


def score(task: Task, records: list[dict], ar_records: list[dict] | None, loglik_model=None) -> dict:
    """Per-item scores (``scores``, in item order) and the task's extra numbers."""
    texts = [r["text"] for r in records]
    if task.kind == "humaneval":
        from vllm_prove.eval import humaneval

        problems = humaneval.load_problems()
        outcomes = humaneval.check([problems[item.reference["index"]] for item in task.items], texts)
        return {"scores": [float(o.passed) for o in outcomes],
                "timed_out": sum(o.status == "timed out" for o in outcomes)}
    if task.kind == "answer":
        return {"scores": [float(scoring.answer_correct(t, item.reference["answer"]))
                           for t, item in zip(texts, task.items)]}
    if task.kind == "lm-eval":
        return _lm_eval_scores(task, texts)
    extra = {}  # heldout: the quality proxy of the zoo
    if loglik_model is not None:
        extra["loglik"] = round(mean_loglik(loglik_model, records), 4)
    if ar_records is None:
        return {"scores": None, **extra}
    pairs = [(r["token_ids"], a["token_ids"]) for r, a in zip(records, ar_records)]
    return {"scores": [common_prefix_length(t, a) / max(1, len(t)) for t, a in pairs],
            "exact_ar": sum(t == a for t, a in pairs) / len(pairs), **extra}


def _lm_eval_scores(task: Task, texts: list[str]) -> dict:
    """lm-eval's own filters and metrics (its evaluator's post-processing, one response per doc)."""
    lm_task = task.lm_task
    if task.answer_match:  # the SDD paper's normalized answer match against lm-eval's target
        return {"scores": [float(scoring.answer_correct(text, str(lm_task.doc_to_target(inst.doc))))
                           for inst, text in zip(lm_task.instances, texts)], "lm_eval_metric": "answer_match"}
    for inst, text in zip(lm_task.instances, texts):
        inst.resps = [text]
    lm_task.apply_filters()
    key = next(iter(lm_task.instances[0].filtered_resps))
    per_doc = [lm_task.process_results(inst.doc, [inst.filtered_resps[key]]) for inst in lm_task.instances]
    metric = next(iter(per_doc[0]))
    means = {m: round(sum(float(d[m]) for d in per_doc) / len(per_doc), 4) for m in per_doc[0]}
    return {"scores": [float(d[metric]) for d in per_doc], "lm_eval_metric": metric, "lm_eval_filter": key,
            "lm_eval_metrics": means}


def mean_loglik(model, records: list[dict]) -> float:
    """Mean log-probability per generated token under ``model`` (fp32, teacher-forced)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for r in records:
            if not r["token_ids"]:
                continue
            ids = torch.tensor([r["prompt_token_ids"] + r["token_ids"]])  # [1, prompt + generated]
            logits = model(ids).logits[0, len(r["prompt_token_ids"]) - 1: -1]  # [num_tokens, vocab]
            logp = torch.log_softmax(logits.double(), -1)
            total += float(logp.gather(1, torch.tensor(r["token_ids"])[:, None]).sum())
            count += len(r["token_ids"])
    return total / count if count else math.nan


def speed(records_by_task: dict[str, list[dict]]) -> dict[str, dict]:
    """Per task: tokens, attributed in-flight seconds and spec-decode counters (see module doc)."""
    batches = defaultdict(list)
    for task, records in records_by_task.items():
        for r in records:
            batches[(r["engine"], r["batch"])].append((task, r))
    out = {task: {"num_tokens": 0, "seconds": 0.0, "drafts": 0.0, "accepted": 0.0, "per_position": [],
                  "engines": set()} for task in records_by_task}
    for (engine, _), members in batches.items():
        shares = scoring.attributed_seconds([(r["start"], r["end"]) for _, r in members])
        batch_tokens = sum(len(r["token_ids"]) for _, r in members) or 1
        spec = members[0][1]["spec"]
        for (task, r), share in zip(members, shares):
            entry, weight = out[task], len(r["token_ids"]) / batch_tokens
            entry["num_tokens"] += len(r["token_ids"])
            entry["seconds"] += share
            entry["drafts"] += weight * spec.get("num_drafts", 0)
            entry["accepted"] += weight * spec.get("num_accepted_tokens", 0)
            positions = spec.get("accepted_per_position", [])
            entry["per_position"] += [0.0] * (len(positions) - len(entry["per_position"]))
            for j, count in enumerate(positions):
                entry["per_position"][j] += weight * count
            entry["engines"].add(engine)
    return {task: _speed_fields(entry) for task, entry in out.items()}


def _speed_fields(entry: dict) -> dict:
    drafts, per_position = entry["drafts"], entry["per_position"]
    acceptance = [c / drafts for c in per_position] if drafts else []
    # committed = 1 + accepted drafts; a cycle accepting >= j + 1 drafts counts at position j
    histogram = {}
    if drafts:
        at_least = [drafts] + per_position
        histogram = {str(c + 1): round((at_least[c] - (at_least[c + 1] if c + 1 < len(at_least) else 0)) / drafts, 4)
                     for c in range(len(at_least))}
    return {"tokens_per_s": round(entry["num_tokens"] / entry["seconds"], 2) if entry["seconds"] > 0 else None,
            "num_tokens": entry["num_tokens"], "seconds": round(entry["seconds"], 4),
            "committed_per_cycle": round(1 + entry["accepted"] / drafts, 4) if drafts else 1.0,
            "acceptance_per_position": [round(a, 4) for a in acceptance], "committed_histogram": histogram,
            "engines": len(entry["engines"])}


def build_report(tasks: list[Task], runs, records: dict[str, dict[str, list[dict]]]) -> dict:
    """``{task: {label: {...}}}`` from every run's records (in item order)."""
    models = {}
    speeds = {run.label: speed(records[run.label]) for run in runs}
    report: dict[str, dict] = {}
    for task in tasks:
        scored = {}
        for run in runs:
            ar = _ar_label(runs, run)
            model = _loglik_model(models, run.cfg) if task.kind == "heldout" else None
            scored[run.label] = score(task, records[run.label][task.name],
                                      records[ar][task.name] if ar else None, model)
        report[task.name] = {}
        for run in runs:
            ar = _ar_label(runs, run)
            entry = {"method": run.cfg.method.value, "concurrency": run.concurrency, "items": len(task.items)}
            scores = scored[run.label]["scores"]
            if scores is not None:
                entry[task.metric] = round(sum(scores) / len(scores), 4)
                entry["ci95"] = [round(x, 4) for x in scoring.bootstrap_ci(scores)]
                base = scored[ar]["scores"] if ar else None
                if ar and ar != run.label and base is not None:
                    entry["delta_vs_ar"] = round(entry[task.metric] - sum(base) / len(base), 4)
                    entry["delta_ci95"] = [round(x, 4) for x in scoring.paired_bootstrap_ci(scores, base)]
            entry |= {k: v for k, v in scored[run.label].items() if k != "scores"} | speeds[run.label][task.name]
            ar_speed = speeds[ar][task.name]["tokens_per_s"] if ar else None
            if ar_speed and entry["tokens_per_s"]:
                entry["speedup_vs_ar"] = round(entry["tokens_per_s"] / ar_speed, 3)
            report[task.name][run.label] = entry
    return report


def _loglik_model(models: dict, cfg):
    from vllm_prove.paths import zoo_path

    path = cfg.proposer or zoo_path("proposer")
    if path not in models:
        import torch
        from transformers import AutoModelForCausalLM

        models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return models[path]


# -- files -------------------------------------------------------------------------------------

def write(report: dict, out: Path, runs, settings: dict) -> None:
    """report.json, report.md, run.json and the plots."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    machine = {"cpus": __import__("os").cpu_count(), "cuda": torch.cuda.is_available()}
    (out / "run.json").write_text(json.dumps({"settings": settings, "machine": machine,
                                              "methods": {r.label: r.cfg.model_dump(mode="json") for r in runs}},
                                             indent=2) + "\n")
    plot(report, out)


def _fmt(value, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(format(v, spec) for v in value) + "]"
    return format(value, spec) if isinstance(value, float) else str(value)


def markdown(report: dict) -> str:
    lines = ["# vllm-prove eval", ""]
    for task, methods in report.items():
        metric = next((k for k in ("pass@1", "accuracy", "agreement") if any(k in e for e in methods.values())),
                      "agreement")
        lines += [f"## {task}", "", f"| method | {metric} | 95% CI | delta vs AR [95% CI] | tok/s | x AR | tokens | "
                  "seconds | committed/cycle | engines |", "|" + " --- |" * 10]
        for label, e in methods.items():
            delta = f"{_fmt(e.get('delta_vs_ar'), '+.3f')} {_fmt(e.get('delta_ci95'), '+.3f')}" \
                if "delta_vs_ar" in e else "-"
            lines.append(f"| {label} | {_fmt(e.get(metric))} | {_fmt(e.get('ci95'))} | {delta} | "
                         f"{_fmt(e['tokens_per_s'], '.1f')} | {_fmt(e.get('speedup_vs_ar'), '.2f')} | "
                         f"{e['num_tokens']} | "
                         f"{_fmt(e['seconds'], '.2f')} | {_fmt(e['committed_per_cycle'], '.2f')} | {e['engines']} |")
        extras = {label: {k: e[k] for k in ("loglik", "exact_ar", "timed_out", "lm_eval_metrics") if k in e}
                  for label, e in methods.items()}
        if any(extras.values()):
            lines += [""] + [f"- {label}: " + ", ".join(f"{k} = {v}" for k, v in x.items())
                             for label, x in extras.items() if x]
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, out: Path) -> None:
    """frontier.png (quality vs tokens/s), committed_histogram.png, position_acceptance.png and,
    with several concurrencies, concurrency.png (tokens/s over AR's by requests in flight)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for label, e in report[task].items():
            metric = next((k for k in ("pass@1", "accuracy", "agreement") if k in e), None)
            if metric and e["tokens_per_s"]:
                ax.scatter(e["tokens_per_s"], e[metric], label=label)
                lo, hi = e["ci95"]
                ax.vlines(e["tokens_per_s"], lo, hi, alpha=0.4)
        ax.set(title=task, xlabel="tokens/s per engine", ylabel=metric or "quality")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
    first = report[tasks[0]]
    labels = [label for label, e in first.items() if e["committed_histogram"]]
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, label in enumerate(labels):
        hist = first[label]["committed_histogram"]
        ax.bar([int(c) + i * width for c in hist], list(hist.values()), width=width, label=label)
    ax.set(title=f"committed tokens per cycle ({tasks[0]})", xlabel="tokens committed", ylabel="share of cycles")
    _save(fig, ax, out / "committed_histogram.png", labels, plt)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        acceptance = first[label]["acceptance_per_position"]
        ax.plot(range(1, len(acceptance) + 1), acceptance, marker="o", label=label)
    ax.set(title=f"per-position acceptance ({tasks[0]})", xlabel="draft position", ylabel="share of cycles",
           ylim=(0, 1.05))
    _save(fig, ax, out / "position_acceptance.png", labels, plt)
    _plot_concurrency(report, out, plt)


def _save(fig, ax, path: Path, labels, plt) -> None:
    if labels:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_concurrency(report: dict, out: Path, plt) -> None:
    entries = [(label, e) for methods in report.values() for label, e in methods.items()]
    if len({e["concurrency"] for _, e in entries}) < 2:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    task = next(iter(report))
    curves = defaultdict(list)
    for label, e in report[task].items():
        curves[label.rsplit("@c", 1)[0]].append((e["concurrency"], e.get("speedup_vs_ar")))
    for name, points in curves.items():
        points = sorted(p for p in points if p[1] is not None)
        ax.plot([c for c, _ in points], [s for _, s in points], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="requests in flight per engine", ylabel="tokens/s / AR", title=f"concurrency ({task})")
    _save(fig, ax, out / "concurrency.png", list(curves), plt)
