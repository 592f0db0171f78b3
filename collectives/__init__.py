"""Collective algorithms, written against the interfaces in ``transport.base`` only.

``x.py`` runs collective x among the ranks of one node, over a ``StepChannel``; ``x_net.py``
runs it in a group that spans nodes, as local phases (``x.py``'s algorithms over the node's
channel) around network phases (``net.NetCall`` over the group's ``NetTransport``).
"""
