"""``python -m astraflow`` (and ``torchrun ... -m astraflow train``): the ``astraflow`` CLI."""

import sys

from astraflow.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
