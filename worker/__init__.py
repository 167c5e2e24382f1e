"""kiln's render worker, in packages by stage; data flows down this list and imports run one way.

- the root: entry points (cli/: the command line, one module per audience; serve: the
  composition root that builds a worker) and the ground every stage stands on (settings: the
  only reader of KILN_* variables, errors, logs, quiet, manifest, profiles, crashes: the crash
  points, startup: a worker start's phases);
- ops/: operators' verbs, never on a job's path (doctor, plan, bench, profile, report, top);
- queue/: a job's path on RQ (claim, lease, job, execution, events, lanes, memory gate); upkeep/
  beside it (pulse, sweep, repair, quarantine, publisher, webhooks, metrics, backlog);
- render/: one job from request to record (inputs, placement, generation, timings);
- files/: where a job's files go (local and S3 stores, image details);
- pipelines/: families, loading, switches, quantize, compile, adapters, the caches, tiny models;
- memory/: what fits on the card (device, the rung table and ladder, peaks, partial, faults:
  the ladder's drills).

A module imports from its own stage, the stages below it and the ground; the ground imports only
the ground; entry points import anything (tests/test_structure.py holds this at any depth,
in-function and TYPE_CHECKING imports included). This package imports nothing: submodules that
touch torch import it themselves.
"""

STAGES = ("ops", "queue", "render", "files", "pipelines", "memory")
ENTRY_POINTS = ("cli", "serve")
