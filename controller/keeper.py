"""`python -m controller.keeper SPEC.json STATE.json`: the process that owns a local cluster (see up_cmd)."""

import sys

from controller.up_cmd import keeper_main

if __name__ == "__main__":
    sys.exit(keeper_main(sys.argv[1], sys.argv[2]))
