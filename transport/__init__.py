"""Transports: how bytes move between ranks.

``transport.base`` defines the small interfaces the algorithms in ``collectives`` are
written against; ``transport.shm`` implements them over shared memory inside one node.
Nothing in this package imports ``torch.distributed``.
"""
