"""Moved to worker/queue/upkeep/metrics.py (issue 37). This alias stands only until the modules
outside worker/queue/ that import the old path name the new one; the lead deletes it then."""

import sys

from worker.queue.upkeep import metrics as _moved
from worker.queue.upkeep.metrics import *  # noqa: F403

sys.modules[__name__] = _moved
