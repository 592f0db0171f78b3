"""Reduction kernels: one place that maps a reduce op to torch's vectorised tensor kernels.

Rules kept here:
* float16 / bfloat16 sums, averages and products accumulate in float32 and round once.
* The result is computed in rank order (v0 op v1 op ... op vN-1) by whichever rank owns a
  slice, so every rank receives bit-identical values.
* PREMUL_SUM multiplies each rank's input by the factor *before* it is shared (its defined
  semantics; it also keeps bf16 gradients from overflowing in the sum).
* Bitwise ops take integers and bool; on bool, SUM/MAX act as OR and PRODUCT/MIN as AND.
* AVG on integers divides the sum and truncates toward zero; AVG/PREMUL_SUM on bool are errors.
* A reduction in phases (across nodes: ``phase_specs``) applies PREMUL_SUM's factor in the
  first phase only and sums afterwards; AVG sums in every phase and divides by the group
  size once, at the end (``finish_phases``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM, BAND, BOR, BXOR = (
    "SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR")
CODES = {name: i + 1 for i, name in enumerate(
    (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM, BAND, BOR, BXOR))}

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_WIDENED = (SUM, AVG, PREMUL_SUM, PRODUCT)  # what low-precision dtypes accumulate in float32
_BOOL = torch.bool
_BOOL_KIND = {SUM: BOR, MAX: BOR, BOR: BOR, PRODUCT: BAND, MIN: BAND, BAND: BAND, BXOR: BXOR}


@dataclass(frozen=True)
class ReduceSpec:
    """A reduction: ``kind`` is one of the names above; ``factor`` is PREMUL_SUM's multiplier."""

    kind: str
    factor: float | torch.Tensor | None = None

    @property
    def code(self) -> int:
        return CODES[self.kind]


def check_supported(spec: ReduceSpec, dtype: torch.dtype) -> None:
    """Raise ValueError if ``spec`` is not defined on ``dtype``."""
    floating = dtype.is_floating_point or dtype.is_complex
    if spec.kind in (BAND, BOR, BXOR) and floating:
        raise ValueError(f"ReduceOp.{spec.kind} needs an integer or bool tensor, got {dtype}")
    if dtype is torch.bool and spec.kind in (AVG, PREMUL_SUM):
        raise ValueError(f"ReduceOp.{spec.kind} is not defined on bool tensors")
    if spec.kind == PREMUL_SUM and not floating:
        raise ValueError(f"ReduceOp.PREMUL_SUM needs a floating-point tensor, got {dtype}")
    if dtype.is_complex and spec.kind in (MIN, MAX):
        raise ValueError(f"ReduceOp.{spec.kind} is not defined on complex tensors")


def stage(dst: torch.Tensor, src: torch.Tensor, spec: ReduceSpec) -> None:
    """Copy this rank's input into shared memory, applying PREMUL_SUM's factor on the way."""
    if spec.kind == PREMUL_SUM:
        torch.mul(src, spec.factor, out=dst)  # type: ignore[arg-type]  # (PREMUL_SUM has one)
    else:
        dst.copy_(src)


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    SUM: torch.add, AVG: torch.add, PREMUL_SUM: torch.add, PRODUCT: torch.mul,
    MIN: torch.minimum, MAX: torch.maximum,
    BAND: torch.bitwise_and, BOR: torch.bitwise_or, BXOR: torch.bitwise_xor,
}
_BOOL_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    BOR: torch.logical_or, BAND: torch.logical_and, BXOR: torch.logical_xor}


class Scratch:
    """Reusable work buffers, grown on demand (bounded by the slot or chunk size).

    ``which`` picks an independent buffer: 0 is the accumulator of ``reduce_into``, so a
    caller that hands ``reduce_into`` views of its own scratch uses another one.
    """

    def __init__(self) -> None:
        self._bufs: dict[int, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype = torch.float32, which: int = 0) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buf = self._bufs.get(which)
        if buf is None or buf.numel() * 4 < nbytes:
            buf = self._bufs[which] = torch.empty((nbytes + 3) // 4, dtype=torch.float32)
        return buf.view(torch.uint8)[:nbytes].view(dtype)


def reduce_into(out: torch.Tensor, inputs: Sequence[torch.Tensor], spec: ReduceSpec, nranks: int,
                scratch: Scratch) -> None:
    """``out = inputs[0] op inputs[1] op ...`` (already-staged inputs, in rank order).

    ``out`` may alias ``inputs[0]`` or ``inputs[1]`` (the kernels are elementwise and those
    are read before ``out`` is written), no later input. AVG divides by ``nranks`` at the end.
    """
    kind, dtype = spec.kind, out.dtype
    if len(inputs) == 1:
        out.copy_(inputs[0])
        if kind == AVG:
            _finish_avg(out, nranks)
        return
    op = _BOOL_KERNELS[_BOOL_KIND[kind]] if dtype is _BOOL else _KERNELS[kind]
    accumulate = dtype in _LOW_PRECISION and kind in _WIDENED
    if accumulate:
        acc = scratch.get(out.numel()).view(out.shape)
        acc.copy_(inputs[0])  # widen first, so even the first pair adds in float32
        rest = inputs[1:]
    else:
        acc = out
        op(inputs[0], inputs[1], out=acc)
        rest = inputs[2:]
    for x in rest:
        op(acc, x, out=acc)
    if kind == AVG:
        _finish_avg(acc, nranks)
    if accumulate:
        out.copy_(acc)


_SUM = ReduceSpec(SUM)


def phase_specs(spec: ReduceSpec) -> tuple[ReduceSpec, ReduceSpec]:
    """(spec of the first phase, spec of the later phases) of a reduction in phases."""
    if spec.kind == AVG:
        return _SUM, _SUM
    if spec.kind == PREMUL_SUM:
        return spec, _SUM
    return spec, spec


def finish_phases(out: torch.Tensor, spec: ReduceSpec, nranks: int) -> None:
    """End a reduction in phases of ``nranks`` ranks' inputs (AVG divides here)."""
    if spec.kind == AVG:
        _finish_avg(out, nranks)


def _finish_avg(t: torch.Tensor, nranks: int) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.div_(nranks)
    else:
        t.div_(nranks, rounding_mode="trunc")
