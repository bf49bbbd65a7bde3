"""`vllm-prove eval` inputs without an engine: task files (a malformed line is named by file
and line), method specs and settings (pydantic, field and range named), presets, shards."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from eval_support import write_lm_eval_task

from vllm_prove.config import CONFIGS_DIR, Method, load_preset
from vllm_prove.errors import ProveError
from vllm_prove.eval import runner, tasks


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_local_task_file_reads_prompts_answers_and_gsm8k_style_answers(tmp_path):
    path = _write(tmp_path / "math.jsonl", [
        json.dumps({"problem": "1+1?", "answer": "2"}),
        "",
        json.dumps({"question": "3*4?", "answer": "so 3*4 = 12\n#### 12", "max_tokens": 8, "stop": ["\n\n"]}),
    ])
    task = tasks.load_task(path)
    assert (task.name, task.kind, task.metric) == ("math", "answer", "accuracy")
    assert [i.prompt for i in task.items] == ["1+1?", "3*4?"]
    assert [i.reference["answer"] for i in task.items] == ["2", "12"]
    assert task.items[1].max_tokens == 8 and task.items[1].stop == ("\n\n",)
    assert len(tasks.load_task(path, limit=1).items) == 1


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "answer": ', "not valid JSON"),
    ('["prompt", "answer"]', "must be a JSON object"),
    ('{"answer": "1"}', "non-empty string `prompt`"),
    ('{"prompt": "x"}', "needs an `answer`"),
    ('{"prompt": "x", "answer": "1", "max_tokens": 0}', "`max_tokens` must be a positive integer"),
    ('{"prompt": "x", "answer": "1", "stop": "\\n"}', "`stop` must be a list"),
])
def test_malformed_task_file_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok", "answer": "1"}), line])
    with pytest.raises(ProveError, match=message) as err:
        tasks.load_task(path)
    assert str(err.value).startswith(f"{path}:2: ")


def test_task_names_and_missing_files(tmp_path):
    assert tasks.parse_task_names("humaneval, heldout,") == ["humaneval", "heldout"]
    with pytest.raises(ProveError, match="at least one task"):
        tasks.parse_task_names(" , ")
    with pytest.raises(ProveError, match="unknown task 'gsm9k'"):
        tasks.load_task("gsm9k")
    with pytest.raises(ProveError, match="no such task file"):
        tasks.load_task(str(tmp_path / "none.jsonl"))
    with pytest.raises(ProveError, match="no problems"):
        tasks.load_task(_write(tmp_path / "empty.jsonl", [""]))


def test_builtin_tasks():
    humaneval = tasks.load_task("humaneval", limit=3)
    assert [i.id for i in humaneval.items] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "\ndef" in humaneval.items[0].stop
    heldout = tasks.load_task("heldout")
    assert len(heldout.items) == 64 and heldout.metric == "agreement"


@pytest.mark.slow
def test_lm_eval_task_from_a_local_json_file(tmp_path):
    write_lm_eval_task(tmp_path, "prove_local_sum", [{"prompt": "2+2=", "target": "4"},
                                                     {"prompt": "3+3=", "target": "6"}], ["\n"], 5)
    task = tasks.load_task("lm-eval:prove_local_sum", lm_eval_include=str(tmp_path))
    assert [(i.prompt, i.max_tokens, i.stop) for i in task.items] == [("2+2=", 5, ("\n",)), ("3+3=", 5, ("\n",))]
    from vllm_prove.eval.report import _lm_eval_scores

    scored = _lm_eval_scores(task, ["4", "7"])  # lm-eval's own metric on our outputs
    assert scored["scores"] == [1.0, 0.0] and scored["lm_eval_metric"] == "exact_match"
    by_answer = tasks.load_task("lm-eval:prove_local_sum@answer", lm_eval_include=str(tmp_path))
    assert by_answer.name == "prove_local_sum@answer"
    # A.5 normalization: "\boxed{4}" and "6.0" are right answers; lm-eval's exact_match says no
    assert _lm_eval_scores(by_answer, ["\\boxed{4}", "6.0"])["scores"] == [1.0, 1.0]
    assert _lm_eval_scores(task, ["\\boxed{4}", "6.0"])["scores"] == [0.0, 0.0]
    with pytest.raises(ProveError, match="only scorer suffix"):
        tasks.load_task("lm-eval:prove_local_sum@judge", lm_eval_include=str(tmp_path))
    with pytest.raises(ProveError, match="lm-eval does not know it"):
        tasks.load_task("lm-eval:prove_no_such_task", lm_eval_include=str(tmp_path))


def test_methods_parse_into_validated_configs():
    runs = runner.parse_methods(["prove:theta=0.05:block_size=16", "ar"], {"dtype": "float32"}, [1])
    assert [r.label for r in runs] == ["ar", "prove:theta=0.05:block_size=16"]  # AR first
    assert runs[1].cfg.method is Method.PROVE and runs[1].cfg.theta == 0.05 and runs[1].cfg.block_size == 16
    sweep = runner.parse_methods(["ar", "prove-lossless"], {}, [1, 4])
    assert [r.label for r in sweep] == ["ar@c1", "ar@c4", "prove-lossless@c1", "prove-lossless@c4"]
    with pytest.raises(ValidationError, match="theta"):
        runner.parse_methods(["prove:theta=2"], {}, [1])
    with pytest.raises(ProveError, match="unknown method 'beam'"):
        runner.parse_methods(["beam"], {}, [1])
    with pytest.raises(ProveError, match="field=value"):
        runner.parse_methods(["prove:theta"], {}, [1])
    with pytest.raises(ProveError, match="named twice"):
        runner.parse_methods(["ar", "ar"], {}, [1])


def test_eval_config_names_field_and_range():
    with pytest.raises(ValidationError, match="replicas"):
        runner.EvalConfig(tasks=["heldout"], methods=["ar"], replicas=0, out="x")
    with pytest.raises(ValidationError, match=r"concurrency must be in \[1, 4096\]"):
        runner.EvalConfig(tasks=["heldout"], methods=["ar"], concurrency=[0], out="x")
    with pytest.raises(ValidationError, match="unknown_field"):
        runner.EvalConfig(tasks=["heldout"], methods=["ar"], out="x", unknown_field=1)


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("eval-*.json")), ids=lambda p: p.stem)
def test_eval_presets_validate(path):
    preset = load_preset(path.stem)
    cfg = runner.EvalConfig(**preset["eval"], decode=preset.get("decode", {}), out="x")
    runs = runner.parse_methods(cfg.methods, cfg.decode, cfg.concurrency)
    assert runs and all(not r.cfg.method.diffusion for r in runs)


def test_shards_resume_only_what_is_missing(tmp_path):
    store = runner.ShardStore(tmp_path, shard_size=2)
    task = tasks.Task("t", "answer", [tasks.Item(str(i), "p", 4) for i in range(3)], "accuracy")
    store.check_settings("ar", {"engine_kwargs": {"seed": 0}})
    store.check_settings("ar", {"engine_kwargs": {"seed": 0}})  # same settings: fine
    with pytest.raises(ProveError, match="other settings"):
        store.check_settings("ar", {"engine_kwargs": {"seed": 1}})
    assert not store.done("ar", "t", 0, 2)
    store.write("ar", "t", 0, [{"index": 1}, {"index": 0}])
    assert store.done("ar", "t", 0, 2) and not store.done("ar", "t", 1, 1)
    store.write("ar", "t", 1, [{"index": 2}])
    assert [r["index"] for r in store.load("ar", task)] == [0, 1, 2]
    task.items = task.items[:1]  # a smaller --limit reads only its items
    assert [r["index"] for r in store.load("ar", task)] == [0]


@pytest.mark.slow
def test_cli_errors_are_one_line_naming_file_line_or_field(tmp_path):
    import subprocess
    import sys

    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok", "answer": "1"}), "{oops"])

    def run(*args):
        return subprocess.run([sys.executable, "-m", "vllm_prove.cli", "eval", *args, "--out", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=120)

    done = run("--tasks", bad, "--methods", "ar")
    assert done.returncode == 2 and f"{bad}:2: not valid JSON" in done.stderr
    done = run("--tasks", "heldout", "--methods", "ar,prove:theta=2")
    assert done.returncode == 2 and "theta" in done.stderr and "less than or equal to 1" in done.stderr
    done = run("--tasks", "heldout", "--methods", "ar", "--replicas", "0", "--ray")
    assert done.returncode == 2 and "replicas" in done.stderr
    assert not (tmp_path / "o" / "shards").exists()  # nothing started
