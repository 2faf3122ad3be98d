"""``python -m mcore_rl.convert ...`` / ``torchrun ... -m mcore_rl.convert ...`` = ``mcore-rl convert ...``."""

import sys

from mcore_rl.cli import main

# The guard matters: torch multiprocessing re-imports __main__ in child processes.
if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
