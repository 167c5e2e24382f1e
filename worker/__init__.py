"""kiln's render worker. Submodules that touch torch import it themselves; this package does not."""
