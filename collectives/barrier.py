"""Barrier: one checked step with no data. Every rank waits until all have arrived."""

from __future__ import annotations

from .context import Context


def barrier(ctx: Context) -> None:
    ctx.finish()
