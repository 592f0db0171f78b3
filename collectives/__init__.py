"""Collective algorithms, written against the interfaces in ``transport.base`` only."""
