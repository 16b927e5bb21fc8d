#!/usr/bin/env bash
# The demo command: install, build the default pair offline (once), run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
exec starjar demo "$@"
