"""``ProcessGroupNeuron``: the c10d face of the backend.

Each method validates its arguments (bad input raises here, before anything is sent:
checks.py), flattens tensors to contiguous 1-D views (non-contiguous ones go through a
copy that is written back), describes the call for the cross-rank check, and hands a
closure running the algorithm from ``collectives`` to the group's ``Submitter``
(submit.py), which gives it to the group's engine (engine.py). Repeated blocking calls
between nodes or inside one take the express lane first (express.py, express_net.py).
Send/recv go to ``PointToPoint`` (p2p_face.py) instead, so they never queue behind
collectives. What fails is turned into the caller's error by ``Failures``
(failures.py); the coalesced calls are coalesced.py's.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by dist

from .collectives import (allgather, allgather_net, allreduce, allreduce_net, alltoall,
                          alltoall_net, barrier, barrier_net, broadcast, broadcast_net,
                          reduce_scatter, reduce_scatter_net, rooted, rooted_net)
from .collectives.context import Plans
from .collectives.net import NetCall
from .collectives.selection import Selection
from .collectives.descriptor import Call, digest
from .collectives.reduce_ops import ReduceSpec, Scratch, check_supported
from .transport.shm.futex import available as futex_available
from . import checks, coalesced, sparse
from .config import Settings
from .engine import CollectiveEngine
from .failures import Failures
from .flat import Flat
from .express import ExpressLane
from .express_net import NetExpressLane
from .flight_recorder import install_signal_handler
from .errors import GroupAbortedError
from .p2p_face import PointToPoint
from .rendezvous import StoreRecord, open_group
from .submit import Submitter
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
_SPECS: dict = {}


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
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._timeout_s = timeout.total_seconds()
        self._group_name = ""
        self._group_desc = ""
        self.settings = settings or Settings.from_env()
        links = open_group(store, rank, size, self.settings, timeout, f"rank {rank}/{size}")
        self._channel, self._topo, self._net = links.channel, links.topo, links.net
        # this generation of the group in the store (shrink.py)
        self.record = StoreRecord(store, links.key, links.auth, links.topo)
        self._algos = FLAT if self._net is None else ACROSS_NODES
        self._scratch = Scratch()
        self._plans = Plans()  # single-step plans, shared with the express lane
        # which algorithm runs (collectives/selection.py), with NEURON_DIST_ALGO's overrides
        self._selection = Selection(self.settings.small_bytes, self.settings.slot_bytes,
                                    self.settings.algo, self.settings.net_cost, links.crowd)
        self._failures = Failures(self._channel, self._net, self._topo.local,
                                  self._timeout_text)
        self._engine = CollectiveEngine(self.label(), self._failures.translate, "?", rank,
                                        size, links.hold)
        self._failures.engine = self._engine
        submitter = Submitter(self._channel, self._topo, self._net, self._engine,
                              self._selection, self._plans, self._scratch,
                              lambda: self._timeout_s, self.label)
        self._submit, self._deadline_seconds = submitter.submit, submitter.deadline_seconds
        self._call = submitter.call
        install_signal_handler()
        self._p2p = PointToPoint(rank, size, self._channel, self._net, self.label,
                                 self._failures.on_p2p_error, lambda: self._timeout_s,
                                 self._timeout_text,
                                 self._topo.local if self._net is not None else None)
        if self._net is None:
            self._express = ExpressLane(self._channel, self._engine, self._scratch,
                                        self._plans, self._selection, reduce_spec)
        else:
            self._express = NetExpressLane(
                self._channel, self._engine, self._scratch, self._plans, self._selection,
                reduce_spec, NetCall(self._net, self._topo, None, 0, 0.0,
                                     scratch=submitter.net_call_scratch), self._algos)
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
        self._engine.label = self.label()
        self._engine.group_name = self._group_key()

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc
        self._engine.label = self.label()
        self._engine.group_name = self._group_key()

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def timeout(self) -> timedelta:
        """The default deadline of the group's operations (``set_timeout`` changes it)."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default deadline of the group's later operations (TorchTitan lowers it
        after the first step)."""
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"set_timeout needs a positive timedelta, got {timeout!r}")
        self._timeout = timeout
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

    def label(self) -> str:
        """The group and this rank, as messages name them: ``'NAME' (DESC) rank R/SIZE``."""
        desc = f" ({self._group_desc})" if self._group_desc else ""
        return f"'{self._group_name or '?'}'{desc} rank {self._rank}/{self._size}"

    def _timeout_text(self) -> str:
        return f"{self._timeout.total_seconds():g} s"

    def __repr__(self):
        return f"ProcessGroupNeuron({self.label()})"

    def layout(self) -> str:
        """Where the group's ranks sit and what joins them, e.g. for a training log."""
        if self._net is None:
            return f"1 node, {self._size} rank(s) over shared memory"
        between = ("MPI" if self.settings.transport == "mpi"
                   else f"{self.settings.rails} rdm rail(s) per peer")
        return (f"{len(self._topo.nodes)} nodes ({self._topo.describe()}); shared memory inside "
                f"a node, {between} between nodes")

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

    def allreduce_coalesced(self, tensors, opts=None):
        """All-reduce of several tensors of one dtype, as one all-reduce of their
        concatenation (coalesced.py)."""
        opts = opts or dist.AllreduceCoalescedOptions()
        return coalesced.all_reduce(tensors, reduce_spec(opts.reduceOp), self._algos,
                                    self._submit_with(opts))

    # ------------------------------------------------------------- all-gather
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or AllgatherOptions()
        inp = checks.single(input_tensors, "allgather input")
        outs = checks.rank_list(output_tensors, inp, self._size, "allgather output")
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
        ``input_list[i]`` (torch's ``all_gather_coalesced``; coalesced.py)."""
        opts = opts or AllgatherOptions()
        return coalesced.all_gather(output_lists, input_list, self._size, self._algos,
                                    self._submit_with(opts))

    def _submit_with(self, opts):
        """``submit(name, call, algo, outputs, nbytes)`` with the call's c10d ``opts``."""
        return lambda name, call, algo, outputs, nbytes: self._submit(name, call, algo, outputs,
                                                                     opts, nbytes)

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
        ins = checks.rank_list(input_tensors, out, self._size, "reduce_scatter input")
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

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        inp = checks.single(input_tensors, "gather input")
        root = checks.rank(opts.rootRank, self._size, "gather root")
        fo = [Flat(t, read=False) for t in checks.root_list(
            output_tensors, inp, root, self._rank, self._size, "gather output")]
        fi = Flat(inp)
        call = Call("gather", inp.dtype, inp.numel(), root=root)
        return self._submit("gather", call,
                            lambda ctx: self._algos.gather(ctx, [f.bytes for f in fo], fi.bytes, root),
                            output_tensors, opts, inp.numel() * inp.element_size(), fo)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        out = checks.single(output_tensors, "scatter output")
        root = checks.rank(opts.rootRank, self._size, "scatter root")
        fis = [Flat(t) for t in checks.root_list(
            input_tensors, out, root, self._rank, self._size, "scatter input")]
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
        out_splits = checks.splits(output, output_split_sizes, self._size, "output")
        in_splits = checks.splits(input, input_split_sizes, self._size, "input")
        fo, fi = Flat(output, read=False), Flat(input)
        es = input.element_size()

        def algo(ctx):
            self._algos.all_to_all(ctx, _cut(fo.bytes, out_splits, es), _cut(fi.bytes, in_splits, es), es)

        call = Call("all_to_all", input.dtype, 0)
        return self._submit("all_to_all_single", call, algo, [output], opts,
                            input.numel() * es, [fo])

    alltoall_base = all_to_all_single

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
    def abort(self, reason: str | None = None) -> None:
        """Fail every pending operation now, tell the peers, and release resources;
        ``reason`` is what the failed operations say (default: the group was aborted)."""
        self._shutdown(GroupAbortedError(reason or f"group {self.label()} was aborted"),
                       abort_peers=True)

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
        combined.complete()
        return combined
    last = works[-1]
    combined.engine = last.engine

    def finish():
        errors = [w.exception() for w in works if w.exception() is not None]
        combined.complete(errors[0] if errors else None)

    # Looking at the combined work looks at the last part (a deferred one runs when waited
    # for, engine.py): hooking it must not wake the engine thread for it.
    combined.op = last.op
    last.add_done_hook(finish, arm=False)
    return combined
