"""All-to-all with arbitrary (uneven, possibly empty) splits over a step channel.

A slot is laid out as [sizes header | block 0 | block 1 | ... | block N-1]. Block k of rank
r's slot carries the next piece of r's data for rank k, which rank k copies out after the
step. The header holds the bytes this rank sends to and expects from every rank (2N int64):
after the first step every rank checks every pair (what i sends to j == what j expects from
i), so all ranks agree on success or on the same error, and on the number of further steps
(from the largest block anywhere). The first step carries data too, so a small all-to-all
takes one step. A rank's block for itself is copied directly, outside shared memory.

Which algorithm moves the rest: the ``all_to_all`` table of selection.py, asked once the
first step has told every rank every size (so every rank gets the same answer) with the
largest block any rank sends another: single copy (by default from
``selection.SINGLE_COPY_BYTES``, see single_copy.py) or slots (the steps above). Whenever
single copy can run (``selection.can_run``: the node's ranks can read each other's memory,
at most ``selection.MAX_ADDRESSES`` ranks, the call's first step, ``selection.RUNS_IN``)
that first step also posts the address of every input block; if the table picks single copy, each rank reads
the rest of its blocks (past the piece that came through the slots) straight out of the
senders' inputs, and a last step keeps everyone until its peers are done reading.

Even splits (every block the same size, at most a slot's block, and the table picks slots
for it) take a plan (``EvenSplit``: slot addresses of both parities and the header words,
made once per block size) that stages by memmove and checks the whole table at once.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Protocol, Sequence

from .context import ALIGN_BYTES, Context, steps_for
from .descriptor import CollectiveMismatch
from .selection import can_run

if TYPE_CHECKING:
    import torch

    from ..transport.base import StepChannel
    from .context import Plans
    from .selection import Selection


def layout(n: int, slot_bytes: int) -> tuple[int, int]:
    """(header bytes, bytes of each rank's block) of an ``n``-rank slot of ``slot_bytes``."""
    header = -(-16 * n // ALIGN_BYTES) * ALIGN_BYTES
    return header, ((slot_bytes - header) // n) // ALIGN_BYTES * ALIGN_BYTES


def choose(selection: Selection, channel: StepChannel, nbytes: int, first: bool = True) -> str:
    """The ``all_to_all`` table's algorithm when the largest block a rank sends another is
    ``nbytes`` (``first``: the call had not stepped when it began)."""
    n = channel.size
    return selection.select("all_to_all", nbytes, n, cma=channel.cma, first=first, addresses=n)


def even_block(selection: Selection, channel: StepChannel, block: int) -> bool:
    """Is ``block`` bytes to and from every rank served by ``EvenSplit`` (one step)?"""
    return single_step(selection, channel, block) is EvenSplit


def single_step(selection: Selection, channel: StepChannel, block: int
                ) -> type[EvenSplit] | None:
    """The single-step plan class (``EvenSplit``) the ``all_to_all`` table's algorithm runs
    an even split of ``block`` bytes per rank with, or None if it runs it otherwise
    (express.py serves a call with the plan the algorithm itself would run)."""
    if block > layout(channel.size, channel.slot_bytes)[1]:  # (a plan holds one step)
        return None
    return PLANS.get(choose(selection, channel, block))


def all_to_all(ctx: Context, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
               element_size: int) -> None:
    """Send uint8 ``ins[k]`` to rank k and receive rank k's block into ``outs[k]``."""
    n = ctx.size
    r = ctx.rank
    block = ins[r].numel()
    first = not ctx.checked
    if first and all(t.numel() == block for t in ins) and all(t.numel() == block for t in outs):
        plan = single_step(ctx.selection, ctx.channel, block)
        if plan is not None:
            ctx.chose(plan.ALGORITHM)
            plan.prepared(ctx.plans, ctx.channel, block).run(
                ctx, [t.data_ptr() for t in outs], [t.data_ptr() for t in ins], element_size)
            return
    header, per = layout(n, ctx.channel.slot_bytes)
    # Bytes move by memmove between data pointers: for the small blocks typical of
    # all_to_all, slicing and copying through torch costs several times the copy itself.
    src_ptr = [t.data_ptr() for t in ins]
    dst_ptr = [t.data_ptr() for t in outs]
    words = ctypes.c_int64 * (2 * n)
    # Posting our blocks' addresses costs nothing; whether they are used is decided from
    # the sizes every rank sees after the first step.
    post = can_run("all_to_all", "single_copy", n, cma=ctx.channel.cma, first=first,
                   addresses=n)
    slot = ctx.my_slot().data_ptr()
    # (typeshed types the slice's value list[c_int64 | int]; a list of ints is one)
    words.from_address(slot)[:] = (
        [t.numel() for t in ins] + [t.numel() for t in outs])  # type: ignore[assignment]
    for k, src in enumerate(ins):
        m = min(per, src.numel())
        if m and k != r:
            ctypes.memmove(slot + header + k * per, src_ptr[k], m)
    ctx.step(tuple(src_ptr) if post else ())
    table = [list(words.from_address(ctx.peer_slot(k).data_ptr())) for k in range(n)]
    check_splits(table, n, element_size, ctx)
    if outs[r].numel():
        outs[r].copy_(ins[r])
    largest = max((table[a][b] for a in range(n) for b in range(n) if a != b), default=0)
    # the same on every rank; single copy only if it can run (then we posted)
    algo = choose(ctx.selection, ctx.channel, largest, first)
    ctx.chose(algo)
    for k, dst in enumerate(outs):
        m = min(per, dst.numel())
        if m and k != r:
            ctypes.memmove(dst_ptr[k], ctx.peer_slot(k).data_ptr() + header + r * per, m)
    ALGORITHMS[algo].rest(ctx, outs, ins, dst_ptr, src_ptr, largest)


class _Rest(Protocol):
    """An ``all_to_all`` algorithm after the first step (``ALGORITHMS``): a class of two
    static methods, ``rest`` (moves the rest of the call) and ``steps`` (how many steps
    that takes)."""

    def rest(self, ctx: Context, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
             dst_ptr: Sequence[int], src_ptr: Sequence[int], largest: int) -> None:
        """Move every block's bytes past the first step's piece."""

    def steps(self, largest: int, per: int) -> int:
        """Steps ``rest`` takes for blocks of at most ``largest`` bytes."""


class _Slots:
    """``slots`` after the first step: the rest a slot's block per step."""

    @staticmethod
    def rest(ctx: Context, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
             dst_ptr: Sequence[int], src_ptr: Sequence[int], largest: int) -> None:
        """Move every block's bytes past the first step's piece, a piece per step."""
        n, r = ctx.size, ctx.rank
        header, per = layout(n, ctx.channel.slot_bytes)
        for i in range(1, steps_for(largest, per)):
            o = i * per
            slot = ctx.my_slot().data_ptr()
            for k, src in enumerate(ins):
                m = max(0, min(per, src.numel() - o))
                if m and k != r:
                    ctypes.memmove(slot + header + k * per, src_ptr[k] + o, m)
            ctx.step()
            for k, dst in enumerate(outs):
                m = max(0, min(per, dst.numel() - o))
                if m and k != r:
                    ctypes.memmove(dst_ptr[k] + o,
                                   ctx.peer_slot(k).data_ptr() + header + r * per, m)

    @staticmethod
    def steps(largest: int, per: int) -> int:
        """Steps ``rest`` takes for blocks of at most ``largest`` bytes."""
        return steps_for(largest, per) - 1


class _SingleCopy:
    """``single_copy`` after the first step (which posted every input block's address)."""

    @staticmethod
    def rest(ctx: Context, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
             dst_ptr: Sequence[int], src_ptr: Sequence[int], largest: int) -> None:
        """Read every block's bytes past the first step's piece from its sender's input,
        then step so that no rank returns while it is being read."""
        n, r = ctx.size, ctx.rank
        done = layout(n, ctx.channel.slot_bytes)[1]
        for k in range(n):
            left = outs[k].numel() - done
            if k != r and left > 0:
                ctx.channel.read_peer(k, dst_ptr[k] + done, ctx.peer_extra(k, n)[r] + done,
                                      left)
        ctx.step()

    @staticmethod
    def steps(largest: int, per: int) -> int:
        """Steps ``rest`` takes: the one that keeps the senders until they are read."""
        return 1


def _steps_after_first(ctx: Context, table: Sequence[Sequence[int]], n: int, per: int) -> int:
    """Steps ``all_to_all`` takes after its first for the split ``table``, on a rank that
    had nothing left to move after the first (its blocks all fit it)."""
    largest = max((table[a][b] for a in range(n) for b in range(n) if a != b), default=0)
    return ALGORITHMS[choose(ctx.selection, ctx.channel, largest)].steps(largest, per)


class EvenSplit:
    """``all_to_all`` of ``block`` bytes to and from every rank, in one step: ``addr[p][k]``
    is rank k's slot of step parity ``p``; ``words`` the header this rank posts, which
    every rank's must equal (``expect``) unless the splits are uneven elsewhere."""

    __slots__ = ("block", "header", "per", "addr", "words", "expect")
    ALGORITHM = "slots"

    def __init__(self, channel: StepChannel, block: int):
        n = channel.size
        self.block = block
        self.header, self.per = layout(n, channel.slot_bytes)
        self.addr = [[channel.slot(k, p).data_ptr() for k in range(n)] for p in (0, 1)]
        self.words = (ctypes.c_int64 * (2 * n))(*([block] * (2 * n)))
        self.expect = list(self.words)

    @classmethod
    def prepared(cls, plans: Plans, channel: StepChannel, block: int) -> EvenSplit:
        """The group's plan for blocks of ``block`` bytes (made on first use)."""
        key = ("all_to_all", block)
        return plans.get(key) or plans.add(key, cls(channel, block))

    def run(self, ctx: Context, dsts: Sequence[int], srcs: Sequence[int], element_size: int
            ) -> None:
        """Send ``block`` bytes at ``srcs[k]`` to rank k, receive rank k's at ``dsts[k]``
        (addresses). Must be the call's first step."""
        n, r, size, header, per = ctx.size, ctx.rank, self.block, self.header, self.per
        slots = self.addr[(ctx.channel.epoch + 1) & 1]
        mine = slots[r]
        ctypes.memmove(mine, self.words, 16 * n)
        for k in range(n):
            if k != r:
                ctypes.memmove(mine + header + k * per, srcs[k], size)
        ctx.step()
        table = [list((ctypes.c_int64 * (2 * n)).from_address(slots[k])) for k in range(n)]
        uneven = any(row != self.expect for row in table)
        if uneven:
            check_splits(table, n, element_size, ctx)  # raises unless uneven among others
        ctypes.memmove(dsts[r], srcs[r], size)
        for k in range(n):
            if k != r:
                ctypes.memmove(dsts[k], slots[k] + header + r * per, size)
        if uneven:  # the others may take more steps: keep step with them
            for _ in range(_steps_after_first(ctx, table, n, per)):
                ctx.step()


def check_splits(table: Sequence[Sequence[int]], n: int, element_size: int, ctx: Context
                 ) -> None:
    """Raise CollectiveMismatch unless what every rank sends to each matches what that one
    expects (``table[k]``: rank k's header, bytes sent to then expected from each rank)."""
    problems = []
    for i in range(n):
        for j in range(n):
            sent, expected = table[i][j], table[j][n + i]
            if sent != expected:
                problems.append(f"rank {i} sends {sent // element_size} elements to rank {j} "
                                f"but rank {j} expects {expected // element_size} from rank {i}")
    if problems:
        raise CollectiveMismatch(f"all_to_all #{ctx.seq} split sizes disagree: "
                                 + "; ".join(problems[:4]), ctx.call, {})


# the ``all_to_all`` table's algorithms (selection.py): name -> what moves the rest of a
# call after its first step, and how many steps that takes
ALGORITHMS: dict[str, _Rest] = {"slots": _Slots, "single_copy": _SingleCopy}
# algorithm -> its single-step plan, for an even split whose blocks fit one step
PLANS = {"slots": EvenSplit}
