#!/usr/bin/env bash
# Run a command as on a smaller CPU: every library that picks kernels by instruction set is held to AVX2
# (ATen, oneDNN, fbgemm, MKL), and with `avx2-no-onednn-int8` torch._int_mm also takes its generic kernel,
# as on an AVX2-only AMD EPYC where oneDNN runs no int8 primitive (the int_mm cliff). The limits are inherited
# by every process the command starts (Ray actors, servers), are named in every benchmark's meta and key the
# kernel cache and the pair measurement apart from the machine's own.
#   scripts/emulate_isa.sh avx2 starjar demo
#   scripts/emulate_isa.sh avx2-no-onednn-int8 python -m benchmarks.cli core --quick --out F
set -euo pipefail
kind="${1:-}"
case "$kind" in
  avx2) ;;
  avx2-no-onednn-int8) export STARJAR_INT_MM_ONEDNN=0 ;;
  *) echo "usage: $0 avx2|avx2-no-onednn-int8 COMMAND [ARGS...]" >&2; exit 2 ;;
esac
shift
[ $# -gt 0 ] || { echo "usage: $0 $kind COMMAND [ARGS...]" >&2; exit 2; }
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
