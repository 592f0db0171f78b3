"""Inter-node "EFA-style" transport: reliable, message-oriented, tagged datagrams over N rails.

``frames`` is the wire format, ``protocol`` the sans-I/O protocol core (segmentation,
per-segment acks, retransmission, reassembly, per-(src, tag) ordering), built in layers:
``endpoint_core``, ``acks``, ``sending``, ``delivery``, ``refusal`` and ``reassembly``,
over the records of ``peer_state``, reporting ``events``. ``driver`` is the
transport's face (requests, cancel, abort, close) and keeps no protocol logic of its own:
``wire`` moves the protocol's frames to and from the TCP rails, ``pending`` keeps the
requests until they end, ``notices`` tells peers of an abort, ``opening`` and ``dialing``
open the rails; ``links`` shares the rails of two processes among all their groups
(reading, routing, JOIN and LEAVE); ``progress`` is the process's one progress engine,
``listener`` and ``handshake`` accept and authenticate rails,
``railmac`` authenticates frames, ``fd_budget`` makes room for a group's rails within the
file-descriptor limit.
Nothing here imports torch or torch.distributed.
"""

from .frames import Frame, FrameError, decode, encode, encode_ack
from .protocol import (Endpoint, FrameRejected, MessageReceived, PeerFailed, ProtocolError,
                       SendCompleted, Transmit)

__all__ = ["Endpoint", "Frame", "FrameError", "FrameRejected", "MessageReceived", "PeerFailed",
           "ProtocolError", "SendCompleted", "Transmit", "decode", "encode", "encode_ack"]
