#!/usr/bin/env bash
# The test command: install everything, then run the default (fast) suite.
# Slower suites: scripts/test.sh -m slow (or gpu, chaos).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec python -m pytest "$@"
