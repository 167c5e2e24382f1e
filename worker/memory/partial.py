"""The partial rung: as many of the denoiser's blocks on the device as fit, the rest streamed by
diffusers' group offload applied to those blocks alone (InvokeAI's partial loading, SD.Next's
balanced offload). Everything else (text encoders, VAE, the denoiser's embeddings, norms and
the UNet's mid block) stays resident, as at full.

Why the other components stay resident rather than offloaded as at model_offload: the rung is
full minus the blocks that do not fit, so its need is full's need minus the streamed blocks'
bytes (measured, not a share), and nothing but the overflow ever crosses the bus; a card so short
that the text encoders must leave too takes model_offload, the next rung down.

The blocks are the items of the denoiser's top-level ModuleLists, in forward order: the
transformers' (double and single) transformer blocks, the video DiTs' (WanTransformer3DModel's
`blocks`, LTXVideoTransformer3DModel's `transformer_blocks`), the UNet's down and up blocks.
They are kept resident in that order while their parameter bytes, plus MARGIN, fit what is left
of the usable memory once everything else is counted; at least one always stays, and one
streams, except in a denoiser of one block, which streams it (keeping it would be full again)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GB = 1e9
# Of each resident block's bytes, kept free beside it: the activations its forward adds on top of
# full's working memory counted in the non-block need, and allocator fragmentation.
MARGIN = 0.10


@dataclass(frozen=True)
class PartialSplit:
    """How a denoiser sits at the partial rung: its first `resident` blocks on the device, the
    other `streamed` ones onloaded block by block at each step."""

    resident: int
    streamed: int
    block_bytes: tuple[int, ...]  # parameter and buffer bytes of each block, in forward order
    reason: str

    @property
    def streamed_bytes(self) -> int:
        return sum(self.block_bytes[self.resident :])


def denoiser_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The items of the denoiser's top-level ModuleLists, in the order the model defines them."""
    return [
        block
        for child in denoiser.children()
        if isinstance(child, torch.nn.ModuleList)
        for block in child
    ]


def module_bytes(module: torch.nn.Module) -> int:
    """Parameter and buffer bytes as stored (a torchao-quantized weight may report its outer
    dtype's size: an overestimate, which errs on the side of streaming)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def plan_split(block_bytes: list[int], usable_gb: float, full_need_gb: float) -> PartialSplit:
    """Blocks kept resident in forward order while they fit: the usable memory minus the
    non-block need (full's need less every block's bytes), each block counted with MARGIN."""
    if not block_bytes:
        raise ValueError("rung partial: the denoiser has no blocks (no top-level ModuleList)")
    total = sum(block_bytes)
    others_gb = max(full_need_gb - total / GB, 0.0)
    room = (usable_gb - others_gb) * GB
    resident, used = 0, 0.0
    for size in block_bytes:
        if used + size * (1 + MARGIN) > room:
            break
        used += size * (1 + MARGIN)
        resident += 1
    count = len(block_bytes)
    # At least one block stays, and one streams: a split that streams nothing is full, which the
    # ladder tried first (or which failed: this rung is what it descended to). One block streams.
    bound = " (at least one stays)" if resident == 0 else ""
    bound = " (at least one streams)" if resident >= count else bound
    bound = " (its only block streams)" if count == 1 else bound
    resident = min(max(resident, 1), count - 1)
    reason = (
        f"{resident} of {count} denoiser blocks resident{bound},"
        f" {count - resident} streamed: {usable_gb:.3f} GB usable, {others_gb:.3f} GB"
        f" for everything but the blocks, {total / GB:.3f} GB of blocks"
        f" (+{MARGIN:.0%} margin each)"
    )
    return PartialSplit(resident, count - resident, tuple(block_bytes), reason)


def split_for(denoiser: torch.nn.Module, usable_gb: float, full_need_gb: float) -> PartialSplit:
    return plan_split([module_bytes(b) for b in denoiser_blocks(denoiser)], usable_gb, full_need_gb)


def place_partial(
    pipe: Any, denoiser: torch.nn.Module, split: PartialSplit, target: torch.device, streams: bool
) -> None:
    """Every module but the streamed blocks onto target, then group offload on each streamed
    block at leaf level, as the group_offload rung does (with CUDA streams: prefetched). Not
    block level: diffusers 0.42.1 offloads a block-level group with module.to(), which a
    group-offloaded ModelMixin nested in it (the UNet blocks' Transformer2DModel) refuses with a
    warning, so without streams those weights would stay on the device. The streamed blocks
    never touch the device while placing, so the placement's peak is the rung's, not full's."""
    from diffusers.hooks import apply_group_offloading

    blocks = denoiser_blocks(denoiser)
    streamed = blocks[split.resident :]
    skip = {id(m) for block in streamed for m in block.modules()}
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module) and component is not denoiser:
            component.to(target)
    for module in denoiser.modules():
        if id(module) not in skip:
            # This module's own tensors only: its children are visited in turn, streamed ones not.
            module._apply(lambda t: t.to(target), recurse=False)
    for block in streamed:
        apply_group_offloading(
            block,
            onload_device=target,
            offload_device=torch.device("cpu"),
            offload_type="leaf_level",
            use_stream=streams,
            non_blocking=streams,
        )
