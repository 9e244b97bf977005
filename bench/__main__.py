"""``python -m topth_ops.bench``: same as ``topth-ops bench``."""

import argparse
import sys

from .cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
