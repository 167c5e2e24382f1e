"""What a family's text encode is asked for (Prompt) and what it returns (Embeds): the image
families' encoders in worker.pipelines.families and the video families' in
worker.pipelines.video take the one and give the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

Embeds = dict[str, Any]  # tensors; Z-Image takes a list of per-prompt tensors


@dataclass(frozen=True)
class Prompt:
    """What a text encode is asked for: the texts, the batch, and whether CFG needs a negative."""

    text: str
    negative: str
    count: int
    cfg: bool
    max_tokens: int | None = None  # the manifest's max_sequence_length (T5 and Qwen encoders)
    image: Image.Image | None = None  # an edit's input, which Qwen-Image-Edit's encoder reads too

    def tokens(self) -> dict[str, int]:
        return {} if self.max_tokens is None else {"max_sequence_length": self.max_tokens}
