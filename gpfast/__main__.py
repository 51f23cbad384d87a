"""``python -m gpfast ...``: the ``gpfast`` command line (see :mod:`gpfast.cli`)."""

import sys

from gpfast.cli import main

if __name__ == "__main__":
    sys.exit(main())
