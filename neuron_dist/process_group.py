"""``ProcessGroupNeuron``: the c10d face of the backend.

Each method validates its arguments (bad input raises here, before anything is sent),
flattens tensors to contiguous 1-D views (non-contiguous ones go through a copy that is
written back), describes the call for the cross-rank check, and hands a closure running
the algorithm from ``collectives`` to the group's engine (engine.py). Send/recv go to
``PointToPoint`` (p2p_face.py) instead, so they never queue behind collectives.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by dist
from torch.autograd import profiler as _profiler

from types import SimpleNamespace

from .collectives import (allgather, allgather_net, allreduce, allreduce_net, alltoall,
                          alltoall_net, barrier, barrier_net, broadcast, broadcast_net,
                          reduce_scatter, reduce_scatter_net, rooted, rooted_net)
from .collectives.context import Context, Plans
from .collectives.net import NetCall
from .collectives.selection import Selection
from .collectives.descriptor import Call, CollectiveMismatch, digest, posted
from .collectives.p2p import P2PError
from .collectives.reduce_ops import ReduceSpec, Scratch, check_supported
from .transport.shm.futex import available as futex_available
from .transport.errors import (ABORTED, ABORTED_MISMATCH, ABORTED_PEER_DIED, ABORTED_TIMEOUT,
                               ChannelClosed, PeerAborted, PeerDied, PeerTimeout)
from . import checks, sparse
from .config import Settings
from .engine import CollectiveEngine
from .flat import Flat
from .express import ExpressLane
from .express_net import NetExpressLane
from .flight_recorder import install_signal_handler
from .errors import (CollectiveMismatchError, GroupAbortedError, NeuronDistError, PeerDiedError,
                     PeerTimeoutError)
from .p2p_face import PointToPoint
from .rendezvous import open_group
from .work import NeuronWork

log = logging.getLogger("neuron_dist")

# The algorithms of a group on one node, and of a group that spans nodes (collectives/*_net.py):
# the same names and signatures.
FLAT = SimpleNamespace(
    all_reduce=allreduce.all_reduce, all_gather=allgather.all_gather,
    reduce_scatter=reduce_scatter.reduce_scatter, broadcast=broadcast.broadcast,
    reduce=rooted.reduce, gather=rooted.gather, scatter=rooted.scatter,
    all_to_all=alltoall.all_to_all, barrier=barrier.barrier)
ACROSS_NODES = SimpleNamespace(
    all_reduce=allreduce_net.all_reduce, all_gather=allgather_net.all_gather,
    reduce_scatter=reduce_scatter_net.reduce_scatter, broadcast=broadcast_net.broadcast,
    reduce=rooted_net.reduce, gather=rooted_net.gather, scatter=rooted_net.scatter,
    all_to_all=alltoall_net.all_to_all, barrier=barrier_net.barrier)
_UNSET = timedelta(milliseconds=-1)
_NO_TIME = timedelta(0)


_SPECS: dict = {}


# Async collectives of a group that spans nodes tried in the caller's thread first: the
# ones whose algorithms say where they may be deferred (``NetCall.deferrable``), up to a
# size where running their local reduction at wait time, instead of overlapped in the
# engine thread, costs little. A deferred call is finished by ``NetCall.resume``, which
# runs only the rest its algorithm handed to ``wait_then`` (and ``run`` the flats' copies
# back): a collective whose ``algo`` does more after the algorithm returns must not be
# named here.
_NET_DEFERRABLE = frozenset(("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"))
NET_DEFER_BYTES = 1 << 20


def reduce_spec(op) -> ReduceSpec:
    """torch ReduceOp (enum or object, PREMUL_SUM with its factor) -> ReduceSpec."""
    kind = getattr(op, "op", op)
    spec = _SPECS.get(kind)
    if spec is not None:
        return spec
    name = str(kind).rsplit(".", 1)[-1]
    if name == "PREMUL_SUM":
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.detach().cpu()
        return ReduceSpec(name, factor)
    if name not in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        raise ValueError(f"unsupported reduce op {op}")
    spec = _SPECS[kind] = ReduceSpec(name)
    return spec


class ProcessGroupNeuron(dist.ProcessGroup):
    """The ``neuron`` process group: collectives over a shared-memory collective core.

    Created by torch through ``init_process_group("neuron")`` / ``new_group``; not meant
    to be constructed directly.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's (prefixed) store, used once to set up shared memory.
    rank, size : int
        This process's rank in the group and the group size.
    timeout : datetime.timedelta
        Default deadline of every operation of the group.
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta,
                 settings: Settings | None = None):
        super().__init__(rank, size)
        # The group's threads (engine, progress) run torch ops. In a process forked from one
        # that used torch's thread pool, the first torch call of each thread re-creates
        # that pool, and two threads doing it at once can see none ("pool INTERNAL ASSERT
        # FAILED ... Invalid thread pool!": torch's post-fork reset is not thread-safe).
        # Doing it once here, before any of our threads exists, leaves nothing to race on.
        torch.set_num_threads(torch.get_num_threads())
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._timeout_seconds = timeout.total_seconds()
        self._timeout_s = timeout.total_seconds()
        self._group_name = ""
        self._group_desc = ""
        self.settings = settings or Settings.from_env()
        links = open_group(store, rank, size, self.settings, timeout, f"rank {rank}/{size}")
        self._channel, self._topo, self._net = links.channel, links.topo, links.net
        self._store_key = links.key  # this generation's keys in the store (shrink.py)
        self._store_auth = links.auth  # checks what the store says (store_auth.py)
        self._net_call_scratch: dict = {}  # NetCall's buffers, kept across calls
        self._algos = FLAT if self._net is None else ACROSS_NODES
        self._scratch = Scratch()
        self._plans = Plans()  # single-step plans, shared with the express lane
        # which algorithm runs (collectives/selection.py), with NEURON_DIST_ALGO's overrides
        self._selection = Selection(self.settings.small_bytes, self.settings.slot_bytes,
                                    self.settings.algo, self.settings.net_cost, links.crowd)
        self._calls = {}
        self._engine = CollectiveEngine(self._label(), self._on_error, "?", rank, size,
                                        links.hold)
        install_signal_handler()
        self._p2p = PointToPoint(rank, size, self._channel, self._net, self._label,
                                 self._on_p2p_error, lambda: self._timeout_s, self._timeout_text,
                                 self._topo.local if self._net is not None else None)
        if self._net is None:
            self._express = ExpressLane(self._channel, self._engine, self._scratch,
                                        self._plans, self._selection, reduce_spec)
        else:
            self._express = NetExpressLane(
                self._channel, self._engine, self._scratch, self._plans, self._selection,
                reduce_spec, NetCall(self._net, self._topo, None, 0, 0.0,
                                     scratch=self._net_call_scratch), self._algos)
        self._closed = False
        log.info("neuron: group rank %d/%d ready on node %r: shared memory %.1f MiB reserved "
                 "(slot %d KiB x2 per rank; %d KiB per send/recv pair on first use), one-step "
                 "all_reduce <= %d KiB, spin %s, futex %s", rank, size,
                 self.settings.node_name or "auto", self._channel.layout.eager_bytes / 2**20,
                 self.settings.slot_bytes >> 10, self.settings.mailbox_bytes >> 10,
                 self.settings.small_bytes >> 10,
                 self._channel.spin,
                 "on" if futex_available else "off")

    # ---------------------------------------------------------------- identity
    def getBackendName(self) -> str:
        return "neuron"

    def name(self) -> str:
        return "neuron"

    def setGroupName(self, name: str) -> None:
        self._group_name = name
        self._engine.label = self._label()
        self._engine.group_name = self._group_key()

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc
        self._engine.label = self._label()
        self._engine.group_name = self._group_key()

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default deadline of the group's later operations (TorchTitan lowers it
        after the first step)."""
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"set_timeout needs a positive timedelta, got {timeout!r}")
        self._timeout = timeout
        self._timeout_seconds = timeout.total_seconds()
        self._timeout_s = timeout.total_seconds()

    # ------------------------------------------------------ per-device backend
    # torch asks the per-device c10d Backend for capabilities (pg._device_types,
    # pg._get_backend(device)): dcp.async_save, FSDP2's ProcessGroupAllocMixin,
    # _get_pg_default_device. A Python ProcessGroup subclass registers none and
    # c10d.Backend cannot be subclassed from Python, so the group answers for itself.
    @property
    def _device_types(self):
        return [torch.device("cpu")]

    def _get_backend(self, device):
        if torch.device(device).type != "cpu":
            raise RuntimeError(f"neuron: no backend for device {device} (CPU tensors only)")
        return self

    def supports_tensor_alloc(self, device) -> bool:
        return False

    supports_splitting = False
    # torch's dist.shrink_group would register what a shrink returns as a C++ c10d Backend,
    # which a Python class cannot be: neuron_dist.shrink_group instead (shrink.py says why)
    supports_shrinking = False
    supports_coalescing = False
    supports_time_estimate = False

    def _group_key(self) -> str:
        desc = f" ({self._group_desc})" if self._group_desc else ""
        return f"'{self._group_name or '?'}'{desc}"

    def _label(self) -> str:
        desc = f" ({self._group_desc})" if self._group_desc else ""
        return f"'{self._group_name or '?'}'{desc} rank {self._rank}/{self._size}"

    def __repr__(self):
        return f"ProcessGroupNeuron({self._label()})"

    def layout(self) -> str:
        """Where the group's ranks sit and what joins them, e.g. for a training log."""
        if self._net is None:
            return f"1 node, {self._size} rank(s) over shared memory"
        between = ("MPI" if self.settings.transport == "mpi"
                   else f"{self.settings.rails} rdm rail(s) per peer")
        return (f"{len(self._topo.nodes)} nodes ({self._topo.describe()}); shared memory inside "
                f"a node, {between} between nodes")

    # ------------------------------------------------------------- machinery
    def _deadline_seconds(self, opts) -> float:
        t = getattr(opts, "timeout", _UNSET)
        if t is None or t <= _NO_TIME:  # (unset: c10d's -1 ms; a comparison, not a call)
            return self._timeout_seconds
        return t.total_seconds()

    def _submit(self, name: str, call: Call, algo, outputs, opts, nbytes: int, flats=()):
        if _profiler._is_profiler_enabled:  # name the collective in torch.profiler traces
            with _profiler.record_function(f"neuron:{name}", f"group={self._label()} bytes={nbytes}"):
                return self._submit_now(name, call, algo, outputs, opts, nbytes, flats)
        return self._submit_now(name, call, algo, outputs, opts, nbytes, flats)

    def _submit_now(self, name: str, call: Call, algo, outputs, opts, nbytes: int, flats=()):
        seconds = self._deadline_seconds(opts)
        work = NeuronWork(outputs, name)
        channel, scratch, selection = self._channel, self._scratch, self._selection
        net, topo, plans = self._net, self._topo, self._plans

        async_op = bool(getattr(opts, "asyncOp", False))
        # A small async collective runs now, its wait deferred if a peer is behind
        # (engine.py): no thread hand-off when the caller waits soon after. In a one-node
        # group its first step is published in shared memory; across nodes (every rank
        # alone on its node) its messages are posted (net.py, "Deferring the wait of an async
        # call").
        deferrable = None
        if async_op:
            if net is None:
                if nbytes <= channel.slot_bytes:
                    deferrable = channel
            elif (nbytes <= NET_DEFER_BYTES and name in _NET_DEFERRABLE
                    and len(topo.local) == 1):
                deferrable = NetCall(net, topo, call, 0, 0.0, scratch=self._net_call_scratch)

        def run(seq: int, rec) -> None:
            deadline = time.monotonic() + seconds
            if deferrable is not None and net is not None:
                deferrable.again(seq, deadline)
                if deferrable.deferred():  # its first run posted everything: finish it
                    deferrable.resume()
                    for f in flats:
                        f.finish()
                    return
            ctx = Context(channel, call, seq, deadline, scratch, selection, plans, rec)
            if net is not None:
                if deferrable is not None:  # the same NetCall each time the call runs
                    ctx.net_call = deferrable
                else:
                    ctx.net_call = NetCall(net, topo, call, seq, deadline,
                                           scratch=self._net_call_scratch)
            algo(ctx)
            for f in flats:
                f.finish()

        if not (deferrable is not None
                and self._engine.try_now(run, work, name, deferrable, call, nbytes)):
            self._engine.submit(run, work, async_op, name, call, nbytes,
                                None if net is not None else channel.peers_published)
        return work

    def _on_p2p_error(self, exc: BaseException, what: str):
        """``_on_error`` for a send or receive, which the collective engine does not see:
        a fatal failure (the peers are told) also breaks the engine here, so this rank's
        later collectives fail at once naming it, as after a collective's failure."""
        error, fatal = self._on_error(exc, what)
        if fatal:
            self._engine.mark_broken(error)
        return error, fatal

    def _on_error(self, exc: BaseException, what: str):
        """Translate a failure into the user-facing error; say whether it is fatal."""
        if isinstance(exc, CollectiveMismatch):
            error = CollectiveMismatchError(f"{what}: {exc}")
            if self._net is None:  # every rank saw every call: the group stays aligned
                return error, False
            # Across nodes, messages of the mismatched calls may be left in flight, and the
            # ranks of this node that exchanged nothing with the culprit must hear of it.
            self._channel.abort(str(error), ABORTED_MISMATCH)
            self._net.abort(str(error), ABORTED_MISMATCH)
            return error, True
        kind = ABORTED
        if isinstance(exc, PeerTimeout):
            detail = str(exc) if exc.network else \
                self._describe_laggards(exc.ranks)
            error = PeerTimeoutError(
                f"{what}: Timed out after {self._timeout_text()}: {detail}")
            kind = ABORTED_TIMEOUT
        elif isinstance(exc, PeerDied):
            error = PeerDiedError(f"{what}: rank {self._peer(exc.rank)} (pid {exc.pid}) died"
                                  if exc.pid else f"{what}: {exc}")
            # a pid: found by this node's shared memory (a local index), else by the network
            error.ranks = (self._peer(exc.rank) if exc.pid else exc.rank,)
            kind = ABORTED_PEER_DIED
        elif isinstance(exc, PeerAborted):
            cls = {ABORTED_TIMEOUT: PeerTimeoutError, ABORTED_PEER_DIED: PeerDiedError,
                   ABORTED_MISMATCH: CollectiveMismatchError}.get(exc.kind, GroupAbortedError)
            if exc.network:  # from another node: tell this node's ranks
                error = cls(f"{what}: rank {exc.rank} aborted the group: {exc.reason}")
                self._channel.abort(str(error), exc.kind)
                return error, True
            error = cls(f"{what}: rank {self._peer(exc.rank)} aborted the group: {exc.reason}")
            if self._net is not None:
                # The aborting rank tells the other nodes itself, but a rank there may be
                # waiting on this one, and would otherwise see only its rails close when
                # this process goes on to exit: this rank's notice comes first.
                self._net.abort(str(error), exc.kind)
            return error, True
        elif isinstance(exc, ChannelClosed):
            return GroupAbortedError(f"{what}: {exc}"), True
        elif isinstance(exc, (ValueError, TypeError, P2PError)):
            return exc, False
        elif isinstance(exc, NeuronDistError):
            return exc, True
        else:
            error = NeuronDistError(f"{what} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._channel.abort(str(error), kind)
        if self._net is not None:  # ranks on other nodes get the same error class and reason
            self._net.abort(str(error), kind)
        return error, True

    def _peer(self, k: int) -> int:
        """Group rank of the shared-memory channel's rank ``k`` (its node-local index)."""
        return self._topo.local[k] if self._net is not None else k

    def _timeout_text(self) -> str:
        return f"{self._timeout.total_seconds():g} s"

    def _describe_laggards(self, ranks) -> str:
        if self._net is not None:  # ranks are local indices of this node's channel
            return "; ".join(f"rank {self._topo.local[k]} (same node) never arrived"
                             for k in ranks) or "peers did not arrive"
        parts = []
        for k in ranks:
            seq, call = Call.from_words(posted(self._channel, k, self._engine.seq - 1)[0])
            last = (f"its last collective was #{seq} {call.describe()}" if seq > 0
                    else "it has not entered any collective of this group")
            parts.append(f"rank {k} never arrived ({last})")
        return "; ".join(parts) or "peers did not arrive"

    # ------------------------------------------------------------- all-reduce
    def allreduce(self, tensors, opts=None):
        if self._express and opts is not None and not opts.asyncOp and len(tensors) == 1:
            work = self._express.all_reduce(tensors[0], opts, self._deadline_seconds(opts))
            if work is not None:
                return work
        opts = opts or dist.AllreduceOptions()
        if len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return sparse.all_reduce(self, tensors[0], opts)
        t = checks.single(tensors, "allreduce tensor")
        spec = reduce_spec(opts.reduceOp)
        check_supported(spec, t.dtype)
        call = self._call("all_reduce", t.dtype, t.numel(), spec.kind)
        if t.is_contiguous():
            x = t.detach() if t.requires_grad else t
            return self._submit("all_reduce", call,
                                lambda ctx: self._algos.all_reduce(ctx, x, x, spec),
                                [t], opts, t.numel() * t.element_size())
        f = Flat(t)
        return self._submit("all_reduce", call,
                            lambda ctx: self._algos.all_reduce(ctx, f.flat, f.flat, spec),
                            [t], opts, t.numel() * t.element_size(), [f])

    def _call(self, op, dtype, count, reduce=None) -> Call:
        """Call descriptors, cached: training loops repeat the same few calls."""
        key = (op, dtype, count, reduce)
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) > 1024:
                self._calls.clear()
            call = self._calls[key] = Call(op, dtype, count, reduce=reduce)
        return call

    def allreduce_coalesced(self, tensors, opts=None):
        """All-reduce of several tensors of one dtype, as one all-reduce of their concatenation."""
        opts = opts or dist.AllreduceCoalescedOptions()
        spec = reduce_spec(opts.reduceOp)
        for i, t in enumerate(tensors):
            checks.tensor(t, f"allreduce_coalesced tensor {i}")
            checks.same_dtype(t, tensors[0], f"allreduce_coalesced tensor {i}")
            check_supported(spec, t.dtype)
        dtype = tensors[0].dtype if tensors else torch.float32
        counts = [t.numel() for t in tensors]
        call = Call("all_reduce", dtype, sum(counts), reduce=spec.kind, extra=digest(counts))

        def algo(ctx):
            flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else \
                torch.empty(0, dtype=dtype)
            self._algos.all_reduce(ctx, flat, flat, spec)
            o = 0
            for t in tensors:
                t.detach().copy_(flat[o:o + t.numel()].view(t.shape))
                o += t.numel()

        return self._submit("allreduce_coalesced", call, algo, list(tensors), opts,
                            sum(t.numel() * t.element_size() for t in tensors))

    # ------------------------------------------------------------- all-gather
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or AllgatherOptions()
        inp = checks.single(input_tensors, "allgather input")
        outs = self._rank_list(output_tensors, inp, "allgather output")
        checks.numel(inp, outs[self._rank].numel(), "allgather input (vs output[rank])")
        fi = Flat(inp)
        fo = [Flat(o, read=False) for o in outs]
        sizes = [o.numel() for o in outs]
        call = Call("all_gather", inp.dtype, sum(sizes), extra=digest(sizes))
        return self._submit(
            "all_gather", call,
            lambda ctx: self._algos.all_gather(ctx, [f.bytes for f in fo], fi.bytes),
            [list(outs)], opts, inp.numel() * inp.element_size(), fo)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """All-gather of several tensors as one: ``output_lists[r][i]`` receives rank r's
        ``input_list[i]`` (torch's ``all_gather_coalesced``: one list per rank, each holding
        one tensor per input). The inputs travel concatenated, in one all_gather."""
        opts = opts or AllgatherOptions()
        for i, t in enumerate(input_list):
            checks.tensor(t, f"all_gather_coalesced input {i}")
            checks.same_dtype(t, input_list[0], f"all_gather_coalesced input {i}")
        checks.length(output_lists, self._size, "all_gather_coalesced output list of lists")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(f"all_gather_coalesced: output list {r} has {len(outs)} tensors, "
                                 f"expected one per input ({len(input_list)})")
            for i, (o, t) in enumerate(zip(outs, input_list)):
                what = f"all_gather_coalesced output[{r}][{i}]"
                checks.tensor(o, what)
                checks.same_dtype(o, t, what)
                checks.numel(o, t.numel(), f"{what} (vs input {i})")
        dtype = input_list[0].dtype if input_list else torch.uint8
        counts = [t.numel() for t in input_list]
        total, size = sum(counts), self._size
        call = Call("all_gather", dtype, total * size, extra=digest(counts))

        def algo(ctx):
            mine = torch.cat([t.detach().reshape(-1) for t in input_list]) if input_list else \
                torch.empty(0, dtype=dtype)
            gathered = torch.empty(total * size, dtype=dtype)
            n = mine.numel() * mine.element_size()
            gb = gathered.view(torch.uint8)
            self._algos.all_gather(ctx, [gb[k * n:(k + 1) * n] for k in range(size)],
                                   mine.view(torch.uint8))
            for r, outs in enumerate(output_lists):
                o = r * total
                for t in outs:
                    t.detach().copy_(gathered[o:o + t.numel()].view(t.shape))
                    o += t.numel()

        return self._submit("all_gather_coalesced", call, algo, output_lists, opts,
                            total * dtype.itemsize)

    def all_gather_single(self, output, input, opts=None):
        if self._express and opts is not None and not opts.asyncOp:
            work = self._express.all_gather(output, input, self._deadline_seconds(opts))
            if work is not None:
                return work
        opts = opts or AllgatherOptions()
        checks.tensor(output, "all_gather output")
        checks.tensor(input, "all_gather input")
        checks.same_dtype(output, input, "all_gather_into_tensor")
        checks.numel(output, input.numel() * self._size,
                     f"all_gather_into_tensor output (input numel x world size {self._size})")
        fi, fo = Flat(input), Flat(output, read=False)
        n = input.numel() * input.element_size()

        def algo(ctx):
            if self._algos is FLAT:
                allgather.all_gather_into(ctx, fo.bytes, fi.bytes)
                return
            ob = fo.bytes
            self._algos.all_gather(ctx, [ob[k * n:(k + 1) * n] for k in range(self._size)], fi.bytes)

        call = Call("all_gather", input.dtype, output.numel())
        return self._submit("all_gather_into_tensor", call, algo, [output], opts, n, [fo])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or AllgatherOptions()
        works = [self.all_gather_single(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return _combined_work(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # --------------------------------------------------------- reduce-scatter
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out = checks.single(output_tensors, "reduce_scatter output")
        ins = self._rank_list(input_tensors, out, "reduce_scatter input")
        checks.numel(out, ins[self._rank].numel(), "reduce_scatter output (vs input[rank])")
        spec = reduce_spec(opts.reduceOp)
        check_supported(spec, out.dtype)
        fo = Flat(out, read=False)
        fis = [Flat(t) for t in ins]
        sizes = [t.numel() for t in ins]
        call = Call("reduce_scatter", out.dtype, sum(sizes), reduce=spec.kind, extra=digest(sizes))
        return self._submit(
            "reduce_scatter", call,
            lambda ctx: self._algos.reduce_scatter(ctx, fo.flat, [f.flat for f in fis], spec),
            [out], opts, sum(sizes) * out.element_size(), [fo])

    def reduce_scatter_single(self, output, input, opts=None):
        if self._express and opts is not None and not opts.asyncOp:
            work = self._express.reduce_scatter(output, input, opts, self._deadline_seconds(opts))
            if work is not None:
                return work
        opts = opts or dist.ReduceScatterOptions()
        checks.tensor(output, "reduce_scatter output")
        checks.tensor(input, "reduce_scatter input")
        checks.same_dtype(output, input, "reduce_scatter_tensor")
        checks.numel(input, output.numel() * self._size,
                     f"reduce_scatter_tensor input (output numel x world size {self._size})")
        spec = reduce_spec(opts.reduceOp)
        check_supported(spec, output.dtype)
        fo, fi = Flat(output, read=False), Flat(input)
        n = output.numel()

        def algo(ctx):
            ins = [fi.flat[k * n:(k + 1) * n] for k in range(self._size)]
            self._algos.reduce_scatter(ctx, fo.flat, ins, spec)

        call = Call("reduce_scatter", output.dtype, input.numel(), reduce=spec.kind)
        return self._submit("reduce_scatter_tensor", call, algo, [output], opts,
                            input.numel() * input.element_size(), [fo])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        works = [self.reduce_scatter_single(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return _combined_work(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------ broadcast &c
    def broadcast(self, tensors, opts=None):
        if self._express and opts is not None and not opts.asyncOp and len(tensors) == 1:
            work = self._express.broadcast(tensors[0], opts, self._deadline_seconds(opts))
            if work is not None:
                return work
        opts = opts or dist.BroadcastOptions()
        t = checks.single(tensors, "broadcast tensor")
        root = checks.rank(opts.rootRank, self._size, "broadcast root")
        f = Flat(t)
        call = Call("broadcast", t.dtype, t.numel(), root=root)
        return self._submit("broadcast", call,
                            lambda ctx: self._algos.broadcast(ctx, f.bytes, root),
                            [t], opts, t.numel() * t.element_size(), [f])

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        t = checks.single(tensors, "reduce tensor")
        root = checks.rank(opts.rootRank, self._size, "reduce root")
        spec = reduce_spec(opts.reduceOp)
        check_supported(spec, t.dtype)
        f = Flat(t)
        call = Call("reduce", t.dtype, t.numel(), root=root, reduce=spec.kind)
        return self._submit("reduce", call,
                            lambda ctx: self._algos.reduce(ctx, f.flat, f.flat, spec, root),
                            [t], opts, t.numel() * t.element_size(),
                            [f] if self._rank == root else [])

    def _rank_list(self, lists, like, what: str, equal_numel: bool = False) -> list:
        """c10d's ``[[one tensor per rank]]`` argument, checked against ``like``."""
        if len(lists) != 1:
            raise ValueError(f"{what}: expected exactly one list of tensors, got {len(lists)}")
        tensors = lists[0]
        checks.length(tensors, self._size, f"{what} list")
        for k, t in enumerate(tensors):
            checks.tensor(t, f"{what} tensor {k}")
            checks.same_dtype(t, like, f"{what} tensor {k}")
            if equal_numel:
                checks.numel(t, like.numel(), f"{what} tensor {k}")
        return tensors

    def _root_list(self, lists, like, root: int, what: str, read: bool) -> list:
        """The root's list of one tensor per rank, checked and flattened; others pass none."""
        if self._rank != root:
            if lists and any(len(x) for x in lists):
                raise ValueError(f"{what}: only the root (rank {root}) may pass a tensor list")
            return []
        return [Flat(t, read=read) for t in self._rank_list(lists, like, what, equal_numel=True)]

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        inp = checks.single(input_tensors, "gather input")
        root = checks.rank(opts.rootRank, self._size, "gather root")
        fo = self._root_list(output_tensors, inp, root, "gather output", read=False)
        fi = Flat(inp)
        call = Call("gather", inp.dtype, inp.numel(), root=root)
        return self._submit("gather", call,
                            lambda ctx: self._algos.gather(ctx, [f.bytes for f in fo], fi.bytes, root),
                            output_tensors, opts, inp.numel() * inp.element_size(), fo)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        out = checks.single(output_tensors, "scatter output")
        root = checks.rank(opts.rootRank, self._size, "scatter root")
        fis = self._root_list(input_tensors, out, root, "scatter input", read=True)
        fo = Flat(out, read=False)
        call = Call("scatter", out.dtype, out.numel(), root=root)
        return self._submit("scatter", call,
                            lambda ctx: self._algos.scatter(ctx, fo.bytes, [f.bytes for f in fis], root),
                            [out], opts, out.numel() * out.element_size(), [fo])

    # -------------------------------------------------------------- all-to-all
    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        checks.length(output_tensors, self._size, "alltoall output list")
        checks.length(input_tensors, self._size, "alltoall input list")
        dtype = None
        for k, t in enumerate(list(output_tensors) + list(input_tensors)):
            checks.tensor(t, "alltoall tensor")
            if dtype is None:
                dtype = t.dtype
            elif t.dtype != dtype:
                raise ValueError(f"alltoall: all tensors must have one dtype ({dtype} vs {t.dtype})")
        fo = [Flat(t, read=False) for t in output_tensors]
        fi = [Flat(t) for t in input_tensors]
        es = input_tensors[0].element_size()
        call = Call("all_to_all", dtype, 0)
        return self._submit(
            "all_to_all", call,
            lambda ctx: self._algos.all_to_all(ctx, [f.bytes for f in fo], [f.bytes for f in fi], es),
            list(output_tensors), opts, sum(t.numel() * es for t in input_tensors), fo)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if (self._express and opts is not None and not opts.asyncOp and not output_split_sizes
                and not input_split_sizes):
            work = self._express.all_to_all(output, input, self._deadline_seconds(opts))
            if work is not None:
                return work
        opts = opts or dist.AllToAllOptions()
        checks.tensor(output, "all_to_all_single output")
        checks.tensor(input, "all_to_all_single input")
        checks.same_dtype(output, input, "all_to_all_single")
        out_splits = self._splits(output, output_split_sizes, "output")
        in_splits = self._splits(input, input_split_sizes, "input")
        fo, fi = Flat(output, read=False), Flat(input)
        es = input.element_size()

        def algo(ctx):
            self._algos.all_to_all(ctx, _cut(fo.bytes, out_splits, es), _cut(fi.bytes, in_splits, es), es)

        call = Call("all_to_all", input.dtype, 0)
        return self._submit("all_to_all_single", call, algo, [output], opts,
                            input.numel() * es, [fo])

    alltoall_base = all_to_all_single

    def _splits(self, t, splits, what) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % self._size:
                raise ValueError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by "
                                 f"the group size {self._size} and no split sizes were given")
            return [rows // self._size * per_row] * self._size
        checks.length(splits, self._size, f"all_to_all_single {what}_split_sizes")
        if any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: {what}_split_sizes {list(splits)} do not sum to "
                             f"the {what}'s dim 0 ({rows})")
        return [s * per_row for s in splits]

    # ------------------------------------------------------------------ barrier
    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._submit("barrier", Call("barrier"), self._algos.barrier, [], opts, 0)

    # --------------------------------------------------------------- send/recv
    def send(self, tensors, dst: int, tag: int = 0):
        t = checks.single(tensors, "send tensor")
        checks.rank(dst, self._size, "send destination rank")
        if dst == self._rank:
            raise ValueError(f"send: rank {dst} cannot send to itself")
        return self._p2p.send(t, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        t = checks.single(tensors, "recv tensor")
        checks.rank(src, self._size, "recv source rank")
        if src == self._rank:
            raise ValueError(f"recv: rank {src} cannot receive from itself")
        return self._p2p.recv(t, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        t = checks.single(tensors, "recv tensor")
        if self._size == 1:
            raise ValueError("recv from any source in a group of size 1 can never complete")
        return self._p2p.recv(t, None, tag)

    # ---------------------------------------------------------------- shutdown
    def abort(self) -> None:
        """Fail every pending operation now and release resources."""
        self._shutdown(GroupAbortedError(f"group {self._label()} was aborted"), abort_peers=True)

    def shutdown(self) -> None:
        """Release resources (destroy_process_group)."""
        self._shutdown(None, abort_peers=False)

    def _shutdown(self, error, abort_peers: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if abort_peers:
            self._channel.abort(str(error))
            if self._net is not None:
                self._net.abort(str(error))
        self._channel.interrupt()
        self._engine.stop(error)
        self._p2p.stop(error)
        if self._net is not None:
            self._net.close(error)
        self._channel.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _cut(flat_bytes, counts, es):
    """Split flat bytes into consecutive pieces of ``counts[k]`` elements."""
    out, o = [], 0
    for c in counts:
        out.append(flat_bytes[o:o + c * es])
        o += c * es
    return out


def _combined_work(works, outputs):
    """One Work for the parts of a coalesced call: done with the last, failed if any failed.

    A group runs its collectives in issue order, so when the last part completes all
    earlier parts have completed too.
    """
    combined = NeuronWork(outputs, works[-1].what if works else "empty coalesced call")
    if not works:
        combined._complete()
        return combined
    last = works[-1]
    combined.engine = last.engine

    def finish():
        errors = [w.exception() for w in works if w.exception() is not None]
        combined._complete(errors[0] if errors else None)

    # Looking at the combined work looks at the last part (a deferred one runs when waited
    # for, engine.py): hooking it must not wake the engine thread for it.
    combined.op = last.op
    last.add_done_hook(finish, arm=False)
    return combined
