"""``Flat``: a flat contiguous alias of a tensor, for algorithms that work on 1-D bytes."""

from __future__ import annotations

import torch

from .collectives import one_thread


class Flat:
    """A flat contiguous alias of ``t``; a non-contiguous ``t`` gets a copy written back.
    The copies run on the calling thread alone, like a collective's (one_thread.py)."""

    __slots__ = ("t", "flat", "copied")

    def __init__(self, t: torch.Tensor, read: bool = True):
        self.t = t
        # (torch view ops cost about a µs each here: made only when needed)
        d = t.detach() if t.requires_grad else t
        self.copied = not d.is_contiguous()
        if not self.copied:
            self.flat = d if d.dim() == 1 else d.view(-1)
        elif read:
            threads = one_thread.enter()
            try:
                self.flat = d.contiguous().reshape(-1)
            finally:
                one_thread.leave(threads)
        else:
            self.flat = torch.empty(d.numel(), dtype=d.dtype)

    @property
    def bytes(self) -> torch.Tensor:
        return self.flat.view(torch.uint8)

    def finish(self) -> None:
        if self.copied:
            threads = one_thread.enter()
            try:
                self.t.detach().copy_(self.flat.view(self.t.shape))
            finally:
                one_thread.leave(threads)
