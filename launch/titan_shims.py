"""CPU shims that let TorchTitan 0.3.0 train on CPU tensors over the ``neuron`` backend.

TorchTitan targets accelerators and a newer torch than 2.13. On a CPU-only host with torch
2.13 a few of its assumptions break before or during the first step; each shim below says
what TorchTitan assumes, where, and why the shim is needed:

====  ======================  ==============================================================
1     device = CPU            ``tools/utils.py`` falls back to ``"cuda"``/``torch.cuda``
2     backend = neuron        ``init_distributed`` takes gloo for CPU (no PREMUL_SUM for FSDP2)
3     triton import stub      three GPU-kernel modules ``import triton`` at import time
4     CPU flex attention      torch 2.13's flex_attention has no backward on CPU
5     set_pg_timeouts         calls ``torch.distributed.set_timeout`` (not in torch 2.13)
6     eager BlockMask         speed only: skips an Inductor build of ``create_block_mask``
7     pre-split PP step       the PP schedule's ``step(arg_mbs=...)`` (not in torch 2.13)
8     gloo: SUM reductions    comparison runs only: gloo has no PREMUL_SUM for FSDP2
====  ======================  ==============================================================

All are runtime monkeypatches of attributes of TorchTitan's modules, applied by
:func:`apply` in the launcher's processes before TorchTitan's trainer is imported. Nothing
in site-packages is edited; the one torch-level change (shim 2's backend map entry) lasts
only for the duration of TorchTitan's ``init_distributed`` call, and shim 7 changes only
the pipeline schedules TorchTitan builds, not torch's classes. Shims 3, 5 and 7 switch
themselves off when Triton / ``torch.distributed.set_timeout`` / a schedule ``step`` that
takes ``arg_mbs`` exist; shim 8 applies to ``--backend gloo`` runs only.

Used by ``launch/titan.py``; see its docstring for how to run.
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import torch

#: Backend that TorchTitan's process groups use by default (the README's ``neuron``).
BACKEND = "neuron"

_applied: list[str] = []


class CpuDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda`` functions TorchTitan calls on its device module.

    TorchTitan's ``DeviceMemoryMonitor`` (components/metrics.py) calls
    ``get_device_name``, ``get_device_properties(...).total_memory``,
    ``reset_peak_memory_stats``, ``empty_cache`` and ``memory_stats`` on the device module;
    ``torch.cpu`` has none of them. TorchTitan's ``set_pg_timeouts`` (distributed/utils.py)
    calls ``barrier(device_ids=[current_device()])``; ``torch.cpu.current_device()`` is
    the string ``"cpu"``, which ``BarrierOptions.device_ids`` (ints) rejects, so
    ``current_device`` answers 0 (device ``cpu:0``). Everything else is ``torch.cpu``'s.
    """

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device=None) -> dict:
        # No caching allocator on CPU: report the process's peak resident set size as
        # both "active" and "reserved" peaks, so TorchTitan's memory column means something.
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _shim_device() -> None:
    """Shim 1 -- the device is CPU, not CUDA.

    TorchTitan assumes: ``torchtitan/tools/utils.py`` computes, at import,
    ``device_type = _get_available_device_type() or "cuda"`` and
    ``device_module = torch.cuda``. On a host without an accelerator that is "cuda", so the
    trainer would call ``torch.cuda.set_device`` and build its meshes, model and batches on
    CUDA. Other modules copy both names at *their* import (``from torchtitan.tools.utils
    import device_type, device_module``), so this must run before they are imported; we
    check afterwards that no TorchTitan module kept a CUDA copy (:func:`check`).
    """
    import torchtitan.tools.utils as tt_utils

    already = [m for m in _modules_with_device_copies() if m != tt_utils.__name__]
    if already:
        raise RuntimeError(f"titan_shims.apply() must run before importing {already}")
    tt_utils.device_type = "cpu"
    tt_utils.device_module = CpuDeviceModule()


def _shim_backend(backend: str) -> None:
    """Shim 2 -- the process-group backend is ``neuron``, not ``nccl``/``gloo``.

    TorchTitan assumes: ``torchtitan/distributed/utils.py:init_distributed`` picks the
    backend as ``Backend.default_device_backend_map[device_type]`` (else ``"nccl"``); it
    has no option to name one. For ``"cpu"`` that is ``gloo``, which cannot run
    TorchTitan's FSDP2 (its reduce-scatter uses ``PREMUL_SUM``, which gloo lacks). The
    shim wraps ``init_distributed`` so that, only during that call, the CPU entry of the
    map reads ``neuron``; everything else TorchTitan does there (timeouts, flight-recorder
    env, autograd threading) is unchanged.
    """
    import torch.distributed as dist
    import torchtitan.distributed.utils as tt_dist_utils

    original = tt_dist_utils.init_distributed
    if getattr(original, "_neuron_shim", False):
        return

    def init_distributed(*args, **kwargs):
        backend_map = dist.Backend.default_device_backend_map
        saved = backend_map.get("cpu")
        backend_map["cpu"] = backend
        try:
            return original(*args, **kwargs)
        finally:
            if saved is None:
                backend_map.pop("cpu", None)
            else:
                backend_map["cpu"] = saved

    init_distributed._neuron_shim = True
    init_distributed.__wrapped__ = original
    tt_dist_utils.init_distributed = init_distributed


#: TorchTitan modules that ``import triton`` at module level (TorchTitan 0.3.0).
TRITON_IMPORTERS = (
    "torchtitan.distributed.minimal_async_ep.kernels",
    "torchtitan.overrides.fused_swiglu",
    "torchtitan.overrides.fused_mla",
)


class _TritonStub(types.ModuleType):
    """Answers any attribute; called with one function it returns it (``@triton.jit``)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _Anything:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()


def _shim_triton() -> str | None:
    """Shim 3 -- ``import triton`` at TorchTitan import time, without Triton.

    TorchTitan assumes: a CUDA build of torch, which depends on ``triton``. Three of its
    modules (:data:`TRITON_IMPORTERS`: MoE expert-parallel and fused MLA/SwiGLU GPU
    kernels) import it at module level, and the llama3 model reaches one of them through
    ``models/common/moe.py -> token_dispatcher.py``, so on CPU torch (no triton)
    ``--module llama3`` fails with ``No module named 'triton'``. None of those kernels
    runs for a dense model on CPU. Instead of installing Triton (about 1 GB) the shim
    imports just those three modules with an ``__import__`` hook that hands *their*
    ``import triton`` / ``import triton.language`` statements a stub (any attribute;
    ``@triton.jit(...)`` returns the function unchanged). The stub never enters
    ``sys.modules`` and the hook is removed right after, so torch and every other module
    still see no Triton. With a real Triton installed it does nothing.
    """
    import builtins
    import importlib
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return None
    stub = _TritonStub("triton")
    stub.language = _TritonStub("triton.language")
    original_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if (level == 0 and (name == "triton" or name.startswith("triton."))
                and (globals or {}).get("__name__") in TRITON_IMPORTERS):
            return stub
        return original_import(name, globals, locals, fromlist, level)

    builtins.__import__ = _import
    try:
        for name in TRITON_IMPORTERS:
            importlib.import_module(name)
    finally:
        builtins.__import__ = original_import
    assert "triton" not in sys.modules
    return "triton=import-stub"


def cpu_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                       enable_gqa=False, return_aux=None, kernel_options=None):
    """``flex_attention(q, k, v, block_mask=...)`` as plain differentiable tensor ops.

    The math flex_attention implements, with the scores materialized (what its own eager
    fallback does): ``softmax(q k^T * scale + mask) v`` with the mask evaluated from the
    BlockMask's ``mask_mod`` (TorchTitan's block-causal document mask), computed in fp32
    and returned in the query's dtype, plus ``AuxOutput(lse=...)`` when asked for.
    Shapes are flex_attention's: (B, H, L, E). Fine for the short sequences this
    launcher trains on (memory grows with L^2).
    """
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("the CPU flex_attention shim supports block masks only, "
                                  "not score_mod")
    B, Hq, L, E = query.shape
    if enable_gqa and key.size(1) != Hq:
        key = key.repeat_interleave(Hq // key.size(1), dim=1)
        value = value.repeat_interleave(Hq // value.size(1), dim=1)
    scale = E ** -0.5 if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, B, None, L, key.size(-2), device=query.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)   # fully masked row -> 0, as flex
    out = torch.matmul(probs, value.float()).to(query.dtype)
    lse = torch.logsumexp(scores, dim=-1) if return_aux is not None and return_aux.lse else None
    return out, AuxOutput(lse=lse)


def _shim_flex_attention() -> None:
    """Shim 4 -- attention that can be trained on CPU.

    TorchTitan assumes: llama3 models (``models/common/config_utils.py``) use
    FlexAttention ("flex", the default), or "varlen" (CUDA flash-attention kernels);
    "sdpa" is refused for language models because every batch carries per-document
    positions (block-causal masks). torch 2.13's ``flex_attention`` refuses CPU inputs that
    require grad ("FlexAttention does not support backward on CPU"), compiled or not, so
    the first training step fails. TorchTitan calls the kernel through the class attribute
    ``FlexAttention._compiled_flex_attn`` (it swaps that attribute itself for deterministic
    runs on ROCm); the shim points it at :func:`cpu_flex_attention`, the same math as
    differentiable tensor ops. The BlockMask (built by TorchTitan as usual) supplies the
    mask.
    """
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = cpu_flex_attention


def _shim_set_pg_timeouts() -> bool:
    """Shim 5 -- ``torch.distributed.set_timeout``, which torch 2.13 does not have.

    TorchTitan assumes: a newer torch. After the first step, ``Trainer.train`` calls
    ``distributed/utils.py:set_pg_timeouts``, which runs a barrier and then
    ``torch.distributed.set_timeout(timeout, group)`` for every mesh group and the default
    group (lowering the init timeout to ``comm.train_timeout_seconds``). torch 2.13 has no
    such function, so step 1 ends with ``AttributeError`` on any device. The shim replaces
    ``set_pg_timeouts`` with the same barrier plus the per-group method torch 2.13 does
    have, ``ProcessGroup.set_timeout(timeout)``. With a torch that has
    ``torch.distributed.set_timeout`` it does nothing.
    """
    import torch.distributed as dist
    import torchtitan.distributed.utils as tt_dist_utils

    if hasattr(dist, "set_timeout"):
        return False

    def set_pg_timeouts(timeout, parallel_dims):
        dist.barrier()
        groups = [mesh.get_group()
                  for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in groups + [dist.distributed_c10d._get_default_group()]:
            group.set_timeout(timeout)

    set_pg_timeouts.__wrapped__ = tt_dist_utils.set_pg_timeouts
    tt_dist_utils.set_pg_timeouts = set_pg_timeouts
    return True


def _shim_block_mask_compile() -> None:
    """Shim 6 (speed only) -- build the attention BlockMask eagerly.

    TorchTitan assumes: compiling is cheap next to a GPU step.
    ``models/common/attention.py`` wraps ``create_block_mask`` in ``torch.compile`` at
    import (``_compiled_create_block_mask``). On CPU that is an Inductor C++ build in every
    rank at step 1 (about 15 s with 4 ranks on 2 cores, against ~3 s for a whole step);
    the eager ``create_block_mask`` builds the same mask. Not needed for correctness.
    """
    import torchtitan.models.common.attention as tt_attention
    from torch.nn.attention.flex_attention import create_block_mask

    tt_attention._compiled_create_block_mask = create_block_mask


def _step_takes_microbatches(schedule_cls) -> bool:
    import inspect

    return "arg_mbs" in inspect.signature(schedule_cls.step).parameters


def _presplit_step(self, *args, target=None, losses=None, return_outputs=True,
                   loss_kwargs=None, arg_mbs=None, kwarg_mbs=None, target_mbs=None,
                   **kwargs):
    """A schedule's ``step`` that also takes pre-split microbatches (shim 7).

    Without ``arg_mbs``, ``kwarg_mbs`` and ``target_mbs`` it is the schedule's own ``step``
    (whole batch, split here into ``n_microbatches``). With any of them (as newer torch's
    ``step`` does), the lists are the microbatches: the body of torch 2.13's
    ``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step`` without its
    ``_split_inputs``, handing the lists to ``_step_microbatches``, which checks their
    number against ``n_microbatches``.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return type(self).step(self, *args, target=target, losses=losses,
                               return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                               **kwargs)
    if args or kwargs or target is not None:
        raise TypeError("pre-split microbatches (arg_mbs, kwarg_mbs, target_mbs) cannot be "
                        "mixed with whole-batch inputs, model kwargs or target")
    multi = isinstance(self, PipelineScheduleMulti)
    if (self._has_backward and (not multi or self._backward_requires_autograd)
            and not torch.is_grad_enabled()):
        raise RuntimeError("step() requires gradients to be enabled for backward "
                           "computation; call eval() under torch.no_grad()")
    stages = list(self._stages) if multi else [self._stage]
    for stage in stages:
        stage.has_backward = self._has_backward
        stage.clear_runtime_states()
    self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                            loss_kwargs=loss_kwargs)
    for stage in stages:
        if stage.is_last and return_outputs:
            return self._merge_outputs(stage.output_chunks)
    return None


def _shim_pipeline_presplit() -> bool:
    """Shim 7 -- pipeline schedules whose ``step`` takes pre-split microbatches.

    TorchTitan assumes: torch's newer ``step(*, arg_mbs, kwarg_mbs, target_mbs)``
    (pytorch/pytorch#188500), to which the trainer hands microbatch lists it made itself.
    ``Trainer.pp_forward_backward_step`` (trainer.py:833) builds one entry per microbatch
    (``local_batch_size // pipeline_parallel_microbatch_size`` of them, each a
    ``pipeline_parallel_microbatch_size`` batch from the dataloader) and calls
    ``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=...,
    loss_kwargs=...)`` (trainer.py:856); ``Validator`` calls ``pp_schedule.eval`` the same
    way (components/validate.py:306). torch 2.13's ``step(*args, target=None, ...,
    **kwargs)`` has no such parameters: the three lists land in ``**kwargs`` as if they
    were the model's keyword arguments, and ``step`` splits them again
    (pipelining/schedules.py:775 and :1975, ``_split_inputs``): ``microbatch.py:351``
    makes as many chunks as the smallest dim 0 among the tensors inside (336), i.e. the
    microbatch size (the empty positional inputs follow, 468), so ``_check_inputs``
    (schedules.py:564) raises "Expecting 4 arg_mbs but got 1" (2 with microbatches of 2),
    on any device and backend. The shim wraps
    ``distributed/pipeline_parallel.py:_build_pipeline_schedule`` (called at line 125) so
    that each schedule it returns gets :func:`_presplit_step` as its ``step`` (``eval``
    calls ``self.step``, so it follows); torch's classes are not changed. With a torch
    whose ``step`` takes ``arg_mbs`` it does nothing.
    """
    from torch.distributed.pipelining.schedules import (PipelineScheduleMulti,
                                                        PipelineScheduleSingle)
    import torchtitan.distributed.pipeline_parallel as tt_pp

    if all(_step_takes_microbatches(c) for c in (PipelineScheduleSingle,
                                                  PipelineScheduleMulti)):
        return False
    original = tt_pp._build_pipeline_schedule
    if getattr(original, "_neuron_shim", False):
        return True

    def _build_pipeline_schedule(*args, **kwargs):
        schedule = original(*args, **kwargs)
        if not _step_takes_microbatches(type(schedule)):
            schedule.step = types.MethodType(_presplit_step, schedule)
        return schedule

    _build_pipeline_schedule._neuron_shim = True
    _build_pipeline_schedule.__wrapped__ = original
    tt_pp._build_pipeline_schedule = _build_pipeline_schedule
    return True


def _shim_gloo_sum_reduction(backend: str) -> bool:
    """Shim 8 (``--backend gloo`` only, to compare) -- FSDP2 reduces with SUM.

    TorchTitan assumes: a backend with ``PREMUL_SUM``. ``distributed/fsdp.py:316``
    (``apply_fsdp_to_decoder``) calls ``disable_fsdp_gradient_division(model)``, which sets
    every FSDP module's gradient divide factor to 1.0 (the loss is already divided by the
    global token count), and torch's FSDP2 then reduce-scatters with
    ``PREMUL_SUM(1/1.0)`` (``_fsdp_collectives.py:850``), which gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"): gloo cannot run any configuration with dp_shard > 1.
    For gloo the shim also calls FSDP2's ``set_force_sum_reduction_for_comms(True)`` on
    those modules: the reductions become SUM and the division by 1.0 is skipped, the same
    arithmetic (multiplying by 1.0 is exact). ``neuron`` runs are not touched: they use
    PREMUL_SUM as TorchTitan asks.
    """
    if backend != "gloo":
        return False
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division
    if getattr(original, "_neuron_shim", False):
        return True

    def disable_fsdp_gradient_division(model):
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division._neuron_shim = True
    disable_fsdp_gradient_division.__wrapped__ = original
    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    return True


def _modules_with_device_copies() -> list[str]:
    return [name for name, mod in list(sys.modules.items())
            if name.startswith("torchtitan") and mod is not None
            and isinstance(getattr(mod, "device_type", None), str)
            and getattr(mod, "device_module", None) is not None]


def apply(backend: str = BACKEND) -> list[str]:
    """Apply every shim once (idempotent); returns their names.

    ``backend`` is the process-group backend shim 2 hands TorchTitan (``gloo`` only to
    compare; shim 8 then makes FSDP2 reduce with SUM, as gloo has no PREMUL_SUM).
    """
    if not _applied:
        _shim_device()
        _shim_backend(backend)
        _applied.extend(["device=cpu", f"backend={backend}"])
        triton = _shim_triton()
        if triton:
            _applied.append(triton)
        _shim_flex_attention()
        _shim_block_mask_compile()
        _applied.extend(["attention=cpu-flex", "block_mask=eager"])
        if _shim_set_pg_timeouts():
            _applied.append("set_pg_timeouts=ProcessGroup.set_timeout")
        if _shim_pipeline_presplit():
            _applied.append("pp_step=pre-split")
        if _shim_gloo_sum_reduction(backend):
            _applied.append("fsdp_reduce=sum")
    return list(_applied)


def check() -> None:
    """Fail if a TorchTitan module imported before the shims still holds CUDA copies."""
    bad = [name for name in _modules_with_device_copies()
           if getattr(sys.modules[name], "device_type") != "cpu"]
    if bad:
        raise RuntimeError(f"TorchTitan modules still use a non-CPU device: {bad}")
