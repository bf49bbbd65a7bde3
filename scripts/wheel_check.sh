#!/usr/bin/env bash
# Packaging check: build a wheel of the repository, install it (not editable) into a fresh venv,
# and run `vllm-prove generate` on the zoo from a folder outside the repository, so the zoo,
# the presets and the prompts must come from the wheel's package data.
# Dependencies are borrowed from .venv (a .pth line; .venv's own editable hook is not read).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$TMP/dist" .
python3 -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q --no-deps --no-index "$TMP"/dist/vllm_prove-*.whl
SITE=$("$TMP/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/.venv/lib/python3.11/site-packages" > "$SITE/zz_deps_from_dev_venv.pth"
cd "$TMP"
"$TMP/venv/bin/python" - <<'PY'
import pathlib, sys, vllm_prove
where = pathlib.Path(vllm_prove.__file__).resolve()
assert str(where).startswith(str(pathlib.Path(sys.prefix).resolve())), f"not the wheel's copy: {where}"
print("vllm_prove from", where)
PY
printf 'def main():\nimport os\n' > prompts.txt
"$TMP/venv/bin/vllm-prove" generate --engine reference --method prove-lossless --preset tiny --prompts prompts.txt \
    --max-tokens 16 --out out.jsonl
test "$(wc -l < out.jsonl)" -eq 2
"$TMP/venv/bin/vllm-prove" generate --method sdd-skip --preset tiny --prompts prompts.txt --max-tokens 16 \
    --out sdd.jsonl --trace trace.jsonl   # the diffusion drafter ships too
test "$(wc -l < sdd.jsonl)" -eq 2 && test -s trace.jsonl
"$TMP/venv/bin/vllm-prove" zoo info > /dev/null
echo "wheel check: OK"
