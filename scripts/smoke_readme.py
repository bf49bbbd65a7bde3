"""CI smoke: the README's quick-start commands, verbatim, in a clean environment.

Runs `vllm-prove serve ...` exactly as the README writes it, with no `VLLM_*` (nor any other
project) variable in its environment, sends one completion and one chat request with the
`openai` client, stops the server, then runs the README's `vllm-prove generate --engine vllm`
command the same way. Exit status 0 only if every step worked.

    .venv/bin/python scripts/smoke_readme.py      # from the repository root (make smoke)
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROPOSER = "vllm_prove/zoo/models/proposer"
SERVE = ("vllm-prove serve vllm_prove/zoo/models/proposer --dtype float32 --additional-config "
         "'{\"prove\": {\"mode\": \"lossless\", \"block_size\": 8}}'")
GENERATE = ("vllm-prove generate --engine vllm --method prove-lossless --prompts "
            "vllm_prove/zoo/models/heldout_prompts.jsonl --max-tokens 32 --out runs/quickstart.jsonl")
PORT = 8000  # vllm serve's default: the README's command names none
STARTUP_TIMEOUT_S = 300


def clean_env() -> dict[str, str]:
    """What a fresh shell has: PATH (with the venv's bin first), HOME, LANG; nothing else."""
    venv_bin = str(Path(sys.executable).parent)
    return {"PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8"}


def readme_has(command: str) -> None:
    if command not in (ROOT / "README.md").read_text():
        raise SystemExit(f"smoke: the README no longer contains the command this smoke runs:\n  {command}")


def serve_smoke(log_path: Path) -> None:
    from openai import OpenAI

    readme_has(SERVE)
    log = log_path.open("w")
    proc = subprocess.Popen(shlex.split(SERVE), cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"smoke: the server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                client.models.list()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise SystemExit(f"smoke: the server did not start in time:\n{log_path.read_text()[-4000:]}")
                time.sleep(2)
        completion = client.completions.create(model=PROPOSER, prompt="def main():\n", max_tokens=16)
        chat = client.chat.completions.create(model=PROPOSER, max_tokens=16,
                                              messages=[{"role": "user", "content": "import os"}])
        if not completion.choices[0].text or completion.usage.completion_tokens == 0:
            raise SystemExit(f"smoke: empty completion {completion}")
        if chat.choices[0].message.content is None or chat.usage.completion_tokens == 0:
            raise SystemExit(f"smoke: empty chat answer {chat}")
        print(f"serve: completion {completion.usage.completion_tokens} tokens, chat {chat.usage.completion_tokens}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def generate_smoke() -> None:
    readme_has(GENERATE)
    out = ROOT / "runs" / "quickstart.jsonl"
    out.unlink(missing_ok=True)
    result = subprocess.run(shlex.split(GENERATE), cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0 or not out.exists():
        raise SystemExit(f"smoke: generate failed ({result.returncode}):\n{result.stderr[-4000:]}")
    print("generate:", result.stdout.strip().splitlines()[-1])


def main() -> int:
    (ROOT / "runs").mkdir(exist_ok=True)
    serve_smoke(ROOT / "runs" / "smoke_serve.log")
    generate_smoke()
    print("smoke: README commands OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
