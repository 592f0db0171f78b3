"""Every driver declares the interfaces of transport/base.py it implements, and implements
every member of them; capabilities are found by those declarations, not by attribute names.

The type checker holds the signatures to the protocols (mypy); this
checks what it cannot: that the declarations are there at run time, that no member falls
through to a protocol's empty body, and the places that used to look for attributes.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from neuron_dist.collectives.net import NetCall
from neuron_dist.transport import base
from neuron_dist.transport.errors import StepDeferred
from neuron_dist.transport.mpi.driver import MpiTransport, Request as MpiRequest
from neuron_dist.transport.rdm.driver import RdmTransport, Request as RdmRequest
from neuron_dist.transport.requests import Request
from neuron_dist.transport.shm.channel import ShmChannel
from neuron_dist.transport.shm.mailbox import ShmMailbox

REPO = Path(__file__).resolve().parents[2]

DECLARED = [
    (ShmChannel, base.StepChannel),
    (ShmMailbox, base.Mailbox),
    (RdmTransport, base.SharedAnySource),
    (MpiTransport, base.ColumnCollectives),
    (Request, base.NetRequest),
    (RdmRequest, base.ClaimableRequest),
    (MpiRequest, base.NetRequest),
    (NetCall, base.Deferrable),
]


def _methods(protocol) -> list[str]:
    """The methods a protocol (and the protocols it extends) declares."""
    names = set()
    for cls in protocol.__mro__:
        if cls.__module__ == base.__name__:
            names |= {n for n, v in vars(cls).items()
                      if inspect.isfunction(v) and not n.startswith("_")}
    return sorted(names)


@pytest.mark.parametrize("impl,protocol", DECLARED, ids=lambda c: c.__name__)
def test_drivers_declare_and_implement_their_protocols(impl, protocol):
    assert protocol in impl.__mro__, f"{impl.__name__} does not declare {protocol.__name__}"
    for name in _methods(protocol):
        defined = getattr(impl, name)
        owner = next(c for c in impl.__mro__ if name in vars(c))
        assert owner.__module__ != base.__name__, \
            f"{impl.__name__}.{name} is the empty body of {owner.__name__}.{name}"
        assert callable(defined)


def test_capabilities_are_declared_not_guessed():
    assert base.NetTransport in RdmTransport.__mro__ and base.NetTransport in MpiTransport.__mro__
    assert base.SharedAnySource not in MpiTransport.__mro__
    assert base.ColumnCollectives not in RdmTransport.__mro__
    # no per-driver flag stands in for a declaration
    assert not hasattr(RdmTransport, "CLAIMS")


def test_requests_keep_no_dict():
    """Declaring a protocol must not give every request a per-object dict."""
    for protocol in (base.NetRequest, base.ClaimableRequest, base.Mailbox):
        assert protocol.__dict__.get("__slots__") == ()
    assert not hasattr(Request(None, 1, memoryview(b"ab"), False), "__dict__")


def test_step_deferred_facts_are_constructor_fields():
    assert (StepDeferred(3).last, StepDeferred(3).resumes) == (False, False)
    e = StepDeferred(3, last=True, resumes=True)
    assert (e.epoch, e.last, e.resumes) == (3, True, True)


# Layers above transport/ that use the contract: no capability sniffing by name.
_ABOVE = ["neuron_dist/engine.py", "neuron_dist/p2p_face.py", "neuron_dist/p2p_any.py",
          "collectives/net.py", "collectives/context.py"]


def _names_a_transport(expr: ast.expr) -> bool:
    """Does ``expr`` (``net``, ``self._net``, ``self.channel``, ...) name a transport?"""
    words = [n.id for n in ast.walk(expr) if isinstance(n, ast.Name)]
    words += [n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)]
    return any(w.strip("_") in ("net", "channel", "transport", "shared_net") for w in words)


@pytest.mark.parametrize("path", _ABOVE)
def test_no_capability_sniffing(path):
    tree = ast.parse((REPO / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and node.args \
                and _names_a_transport(node.args[0]):
            pytest.fail(f"{path}:{node.lineno}: {ast.unparse(node)}")


@pytest.mark.parametrize("path", ["neuron_dist/p2p_any.py", "neuron_dist/p2p_face.py"])
def test_ops_use_the_face_public_interface(path):
    """The Work ops of send/recv (p2p_face.py's, p2p_any.py's) reach the face
    (``PointToPoint``) only through its public names."""
    tree = ast.parse((REPO / path).read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "face") or (
                isinstance(owner, ast.Attribute) and owner.attr == "face"):
            pytest.fail(f"{path}:{node.lineno}: face.{node.attr}")
