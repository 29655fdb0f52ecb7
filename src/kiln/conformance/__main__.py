"""``python -m kiln.conformance ARGS`` is ``kiln conformance ARGS`` (``kiln.cli.conformance``)."""

import sys

from kiln.cli import main

sys.exit(main(["conformance", *sys.argv[1:]]))
