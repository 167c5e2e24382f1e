"""`python -m worker.cli`: the same command as the `kiln` script."""

import sys

from worker.cli import main

sys.exit(main())
