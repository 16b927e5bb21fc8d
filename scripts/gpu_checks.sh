#!/usr/bin/env bash
# The checks that need a CUDA device, in one run: the gpu-marked tests, the graphed decoder's figures
# (benchmarks/probes/gpu_graph_speed.py: graphs against HF's forward, target alone and speculative) and
# lookahead with target and draft servers on the GPU (`starjar bench lookahead --device cuda`), on a pair made
# there. Results go to the folder given (default: the current one).
#   bash scripts/gpu_checks.sh OUT_DIR            on a CUDA machine
#   bash scripts/gpu_checks.sh OUT_DIR --smoke    on a CPU: a tiny pair, to check the script itself
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
pair=$(mktemp -d "${TMPDIR:-/tmp}/starjar-gpu-pair.XXXXXX")
if [ "${2:-}" = "--smoke" ]; then
  device=cpu probe=(--small --repeats 1 --batch-sizes 1 4 --gammas 2) bench=(--quick)
else
  device=cuda probe=() bench=()
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
fi
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$py -m pytest -q -p no:cacheprovider -m gpu tests/starjar/test_cuda_graphs.py 2>&1 | tail -25
$py -m benchmarks.probes.gpu_graph_speed --device "$device" --keep-pair "$pair" "${probe[@]}" \
  --out "$out/gpu_graph_speed.json" 2>&1 | grep -v -e "Writing model" -e "Loading weights"
$py -m benchmarks.cli lookahead --device "$device" --target "$pair/target" --draft "$pair/draft" --dataset own \
  "${bench[@]}" --out "$out/lookahead_gpu.json" 2>&1 | tail -15
rm -rf "$pair"
