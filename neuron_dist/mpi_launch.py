"""``dist.init_process_group`` under ``mpiexec``, without torchrun.

torch's ``env://`` rendezvous (the default) reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``; mpiexec sets its own variables instead (``PMI_RANK``/``PMI_SIZE`` with
MPICH's Hydra, ``OMPI_COMM_WORLD_RANK``/``_SIZE`` with Open MPI, ``PMIX_RANK`` with PMIx
launchers such as ``srun --mpi=pmix``). ``env_from_mpi()`` fills the torch variables in from
MPI itself:

* ``RANK``, ``WORLD_SIZE``: the rank and size of ``MPI_COMM_WORLD``;
* ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: rank and size in
  ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, i.e. among the ranks of this node;
* ``MASTER_ADDR``, ``MASTER_PORT``: rank 0 picks an address (below) and a free port, in
  ``NEURON_DIST_PORT_RANGE`` if set (it binds the port there and closes the socket: the
  same small race torchrun's ``--standalone`` accepts) and broadcasts both.

All six come from MPI, or none: a rank's environment that already sets some of them
(``RANK`` without ``WORLD_SIZE``, a ``LOCAL_RANK``, its own ``MASTER_PORT``) must agree with
MPI's values, or every rank fails with an error naming the rank, the variable and both
values, so ranks can never mix sources and rendezvous at different stores. ``MASTER_ADDR``
is, in order: rank 0's ``MASTER_ADDR`` if set; the IPv4 address of
``NEURON_DIST_SOCKET_IFNAME`` on rank 0; ``127.0.0.1`` when every rank shares rank 0's node
(nothing leaves the host); else the address rank 0's host name resolves to, or, if that is
a loopback address, the first non-loopback IPv4 address of rank 0's interfaces.

``install_env_hook()`` makes that happen by itself, lazily: it wraps torch's ``env://``
rendezvous handler so that, in a process started by an MPI launcher that has no ``RANK``
and was given no rank, ``env_from_mpi()`` runs when ``init_process_group`` rendezvouses.
It is cheap (no MPI) and changes nothing anywhere else: a process without MPI's variables,
or with ``RANK`` set (torchrun, or a child of an initialised rank), or calling
``init_process_group(rank=..., world_size=...)``, goes straight to torch's handler. MPI is
initialised only then, after the user's own ``mpi4py.rc`` settings were made.
"""

from __future__ import annotations

import logging
import os
import socket

from .config import Settings

log = logging.getLogger("neuron_dist")

# (rank, size) variables of MPI launchers; PMIx publishes no size variable.
_LAUNCHER_VARS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMIX_RANK", None))
_SET = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_mpi(environ=None) -> bool:
    """True if an MPI launcher (Hydra/PMI, Open MPI, PMIx) started this process."""
    env = os.environ if environ is None else environ
    return any(rank in env for rank, _ in _LAUNCHER_VARS)


def env_from_mpi() -> dict | None:
    """Set torch's rendezvous variables from MPI; returns those it set, or None.

    Does nothing (returns None, does not touch MPI) unless an MPI launcher started this
    process and ``RANK`` or ``WORLD_SIZE`` is missing. Otherwise initialises MPI through
    mpi4py (if not already) and sets all of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from MPI (rank 0's
    ``MASTER_ADDR``/``MASTER_PORT`` if it has them). Every rank of ``MPI_COMM_WORLD`` must
    call it (it uses collectives on it).

    Raises
    ------
    RuntimeError
        mpi4py is not installed; or, on every rank, some rank's environment already set
        one of the six to a value that differs from MPI's (the error names them all).
    """
    if not launched_by_mpi() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return None
    from .backend import configure_logging
    settings = Settings.from_env()
    configure_logging(settings.debug)  # before any group exists: for the line logged below
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError("this process was started by an MPI launcher without RANK and "
                           "WORLD_SIZE; reading them from MPI needs mpi4py (pip install "
                           "mpi4py, with an MPI library: e.g. pip install mpich)") from e
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    if rank == 0:
        try:
            addr, port = _master_endpoint(local_size == size, settings.socket_ifname)
            choice = (addr, port, None)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not hang
            choice = (None, None, f"{type(e).__name__}: {e}")
    else:
        choice = None
    addr, port, error = world.bcast(choice, root=0)
    if error is not None:
        raise RuntimeError(f"rank 0 could not choose MASTER_ADDR/MASTER_PORT: {error}")
    values = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local_rank,
              "LOCAL_WORLD_SIZE": local_size, "MASTER_ADDR": addr, "MASTER_PORT": port}
    values = {name: str(value) for name, value in values.items()}
    # all from MPI or none: every rank learns of any rank's disagreeing preset variable
    mine = [f"{name}={os.environ[name]} (MPI: {values[name]})" for name in _SET
            if os.environ.get(name) and os.environ[name] != values[name]]
    clashes = [f"rank {r}: {', '.join(c)}" for r, c in enumerate(world.allgather(mine)) if c]
    if clashes:
        raise RuntimeError(
            "started by an MPI launcher without RANK and WORLD_SIZE, but some ranks' "
            "environment already sets rendezvous variables that differ from MPI's, so ranks "
            f"would mix sources: {'; '.join(clashes)}. Unset them, or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT on every rank (then MPI is not asked)")
    done = {name: values[name] for name in _SET if not os.environ.get(name)}
    os.environ.update(values)
    log.info("neuron: rendezvous variables from MPI (rank %d/%d, local %d/%d): %s", rank,
             size, local_rank, local_size, done)
    return done


def _master_endpoint(single_node: bool, ifname: str | None) -> tuple[str, int]:
    """On rank 0: (MASTER_ADDR, MASTER_PORT) to broadcast; without MASTER_ADDR, the address
    of ``ifname`` (``NEURON_DIST_SOCKET_IFNAME``) if given."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        if ifname:
            from .topology import interface_address
            addr = interface_address(ifname)
        elif single_node:
            addr = "127.0.0.1"
        else:
            addr = _routable_address()
    port = os.environ.get("MASTER_PORT")
    if not port:
        # a free port, in NEURON_DIST_PORT_RANGE if set (the store must pass the firewall)
        from .transport.rdm.listener import bind
        port_range = Settings.from_env().port_range
        try:
            with bind(addr, port_range) as s:
                port = s.getsockname()[1]
        except OSError:  # e.g. a MASTER_ADDR that names another host: a free port here
            with bind("0.0.0.0", port_range) as s:
                port = s.getsockname()[1]
    return addr, int(port)


def _routable_address() -> str:
    """This host's address other nodes can reach: its name's, unless that is loopback."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    from .topology import interface_address
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        try:
            addr = interface_address(name)
        except ValueError:
            continue
        if not addr.startswith("127."):
            return addr
    raise RuntimeError("found no non-loopback IPv4 address for MASTER_ADDR; set MASTER_ADDR "
                       "or NEURON_DIST_SOCKET_IFNAME")


# ----------------------------------------------------------------------------- env:// hook

def _wants_mpi_env(url: str) -> bool:
    from urllib.parse import parse_qs, urlparse
    query = parse_qs(urlparse(url).query)
    return launched_by_mpi() and "rank" not in query and not os.environ.get("RANK")


def install_env_hook() -> bool:
    """Wrap torch's ``env://`` rendezvous handler so that ``env_from_mpi()`` runs first
    in processes an MPI launcher started without ``RANK`` (idempotent; no MPI calls here).

    Returns True if the hook is (now) installed.
    """
    import importlib
    try:
        # (``torch.distributed.rendezvous`` the attribute is a function; the module is this)
        rdzv = importlib.import_module("torch.distributed.rendezvous")
        handlers = rdzv._rendezvous_handlers
    except (ImportError, AttributeError):
        return False
    original = handlers.get("env")
    if original is None:
        return False
    if getattr(original, "_neuron_mpi_hook", False):
        return True

    def env_handler(url, *args, **kwargs):
        # a generator like torch's handler: the variables are read at the first next()
        if _wants_mpi_env(url):
            env_from_mpi()
        yield from original(url, *args, **kwargs)

    env_handler._neuron_mpi_hook = True
    env_handler.__wrapped__ = original
    handlers["env"] = env_handler
    return True
