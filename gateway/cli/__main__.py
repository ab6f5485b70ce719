"""`python -m gateway.cli`: the `flowprefill` command (how `serve` starts its workers)."""

import sys

from gateway.cli import main

sys.exit(main())
