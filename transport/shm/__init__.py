"""Intra-node transport: the collective core's shared-memory segment, step channel and mailboxes."""
