"""Units: one process, no ranks forked, no network, seconds per file.

Pure functions (reduction kernels, segment math, descriptors, settings, p2p matching), the
rdm protocol core driven through a simulated lossy network (no sockets), the one-node
collective algorithms run by threads over the fake step channel (helpers/fake_channel.py),
and static checks of the tree (layering, settings, this test tree's own layout).
"""
