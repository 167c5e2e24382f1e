"""The stack's import-time notices, each silenced by its logger and message where it says nothing
an operator can act on, and what matters among them kept to be said once: doctor's torchao line
and the worker's `worker_started` record name the torchao pieces that did not load.

All of them are records on the named library loggers (torchao and transformers have no handler of
their own at import, so Python's last-resort handler printed them bare on stderr; torch prints its
own through a handler on the `torch` logger). A filter on each logger drops only the matching
message: anything else those libraries log still shows. Stdlib only, so `kiln` installs the
filters before any verb imports the stack.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Notice:
    logger: str
    pattern: re.Pattern[str]
    why: str  # why it is safe to drop (or, with a `kept` group, what is kept of it)


NOTICES = (
    Notice(
        "torchao",
        re.compile(r"^Failed to load .*?/torchao/(?P<kept>_C\w*?)\.[^/]*so: "),
        "torchao's wheel carries C++/CUDA kernels built for one CPython and CUDA (_C_mxfp8 for "
        "cpython-310, _C_cutlass_90a for sm90); elsewhere they fail to load, one line each at "
        "every import. Kept: the names, in doctor's torchao line and the worker's start record; "
        "doctor's per-scheme trial says what still runs",
    ),
    Notice(
        "torchao.kernel.intmm",
        re.compile(r"Detected no (?P<kept>triton)\b"),
        "torchao's int8 matmul falls back without Triton (none on CPU, none on ROCm wheels "
        "without it). Kept as 'triton' beside the missing extensions",
    ),
    Notice(
        "torch.utils._pytree",
        re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
        "torchao registers its own enums with register_constant(), which torch 2.13 deprecates: "
        "nothing kiln calls or an operator can change",
    ),
    Notice(
        "transformers.utils.import_utils",
        re.compile(r"requires torchvision \(not installed\); falling back to `\w+Pil`"),
        "the PIL image processors are what kiln's pipelines use (feature extractors beside the "
        "text encoders); torchvision is not one of kiln's dependencies",
    ),
    Notice(
        "diffusers.quantizers.torchao.torchao_quantizer",
        re.compile(r"Unable to import `torchao` Tensor objects"),
        "only affects loading checkpoints saved already quantized by torchao; kiln quantizes "
        "after from_pretrained and never loads those",
    ),
)

_kept: list[str] = []  # what the dropped notices said did not load, in the order met


class _Drop(logging.Filter):
    def __init__(self, notice: Notice) -> None:
        super().__init__()
        self.notice = notice

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.notice.pattern.search(record.getMessage())
        if match is None:
            return True
        kept = match.groupdict().get("kept")
        if kept and kept not in _kept:
            _kept.append(kept)
        return False


def install() -> None:
    """Filter each notice on its logger (again is a no-op). Call before torch is imported."""
    for notice in NOTICES:
        logger = logging.getLogger(notice.logger)
        if not any(isinstance(f, _Drop) and f.notice is notice for f in logger.filters):
            logger.addFilter(_Drop(notice))


def torchao_missing() -> list[str]:
    """torchao's extensions (and Triton) that did not load in this process, as its notices said;
    empty until torchao is imported, or when everything loaded."""
    return list(_kept)
