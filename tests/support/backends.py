"""A backend as kiln's users run one: another Python process with the client and Redis only (no
AWS_*, no KILN_* in its environment), its output piped for the test to read."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def start_backend(module: str, *args: str) -> subprocess.Popen[str]:
    """`python -m module args...` started in the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KILN_"))}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
