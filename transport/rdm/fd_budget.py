"""File descriptors for a group's rails: make room within the process's limit, or say so.

How it works
------------
A group of N ranks with R rails opens R x (N - 1) TCP connections in every rank, one file
descriptor each, on top of what the process already holds (other groups' rails, shared
memory, a data loader's files). At the common default soft limit of 1024 descriptors, a
group of a few hundred ranks with 4 rails does not fit, and the connection that finds no
descriptor fails deep in a dial or an accept (``EMFILE``), or later, somewhere else in the
job. So before a rank publishes its address for a group, ``reserve(n, ...)`` counts the
descriptors open now (``/proc/self/fd``) and checks that ``n`` more, plus ``MARGIN`` for
everything else, fit under the soft limit. If not, it raises the soft limit (an
unprivileged process may, up to the hard limit; many runtimes do the same) and logs it;
if the hard limit is too low as well, it raises ``DescriptorLimit`` with the numbers and
the ways out (a higher ``ulimit -n``, fewer rails). Where ``/proc/self/fd`` is missing,
nothing is checked.
"""

from __future__ import annotations

import logging
import os
import resource

from ..errors import DescriptorLimit

log = logging.getLogger("neuron_dist.rdm")

MARGIN = 128  # descriptors left free for everything else the process opens


def open_descriptors() -> int | None:
    """How many file descriptors this process holds (None: cannot tell here)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (minus the listing's own)
    except OSError:
        return None


def reserve(n: int, what: str, fewer: str = "") -> None:
    """Make sure ``n`` more descriptors (plus ``MARGIN``) can be opened, raising the soft
    limit if needed.

    Parameters
    ----------
    n : int
        Descriptors about to be opened.
    what : str
        What needs them, for messages (e.g. "4 rails to each of 299 peers").
    fewer : str
        How to need fewer, for the error (e.g. "NEURON_DIST_RAILS=1 needs 299").

    Raises
    ------
    DescriptorLimit
        Even the hard limit leaves no room for them.
    """
    held = open_descriptors()
    if held is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = held + n + MARGIN
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise DescriptorLimit(
            f"{what} need {n} file descriptors, {held} are open already and {MARGIN} are kept "
            f"for the rest of the process, but its limit is {hard} (ulimit -n, hard limit): "
            f"raise the limit (ulimit -n {want} or more before the job starts)"
            + (f", or {fewer}" if fewer else ""))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    log.info("neuron: raised this process's file-descriptor soft limit from %d to %d for %s",
             soft, want, what)
