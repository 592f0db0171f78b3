"""Transports: how bytes move between ranks.

``transport.base`` defines the interfaces the algorithms in ``collectives`` are written
against: the step channel inside a node and the between-nodes contract (``NetTransport``,
tagged send/recv with cancel, deadlines, abort and peer failure). ``transport.shm``
implements the first over shared memory; ``transport.rdm`` (TCP rails driven by one
progress engine per process) and ``transport.mpi`` implement the second. ``requests`` and
``errors`` are shared by them. Nothing in this package imports ``torch.distributed``.
"""
