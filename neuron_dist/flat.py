"""``Flat``: a flat contiguous alias of a tensor, for algorithms that work on 1-D bytes."""

from __future__ import annotations

import torch


class Flat:
    """A flat contiguous alias of ``t``; a non-contiguous ``t`` gets a copy written back."""

    __slots__ = ("t", "flat", "copied")

    def __init__(self, t: torch.Tensor, read: bool = True):
        self.t = t
        d = t.detach()
        self.copied = not d.is_contiguous()
        if not self.copied:
            self.flat = d.reshape(-1)
        elif read:
            self.flat = d.contiguous().reshape(-1)
        else:
            self.flat = torch.empty(d.numel(), dtype=d.dtype)

    @property
    def bytes(self) -> torch.Tensor:
        return self.flat.view(torch.uint8)

    def finish(self) -> None:
        if self.copied:
            self.t.detach().copy_(self.flat.view(self.t.shape))
