"""Predict a run's peak training memory, what ``mem/peak_mb`` will read, before training.

    python -m src.memory model=densenet121 batch_size=16 amp=true data=synthetic

One training micro-step is replayed on fake tensors; the rest is counted from sizes, plus a CPU workspace whose
constants were fitted on measured peaks. Design, constants and their fit: docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass

import cachetools
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from src.config import Config, DataConfig, Loader, OptimConfig, OptimName
from src.data.files import split_sizes
from src.data.loaders import to_input
from src.errors import UsageError
from src.execution import Execution
from src.models import build_model
from src.models.layers import activation_gain

MIB = 2**20
GLIBC_MMAP_CEILING = 32 * MIB  # glibc's dynamic mmap threshold rises to at most this: smaller blocks come from its heap
CPU_FIXED_MB = 20.0
CPU_LARGEST_COPIES = 3.0  # oneDNN's reordered copies of the largest activation ...
CPU_COPIED_MB = 64.0  # ... counted up to this size
CPU_HEAP_KEPT = 0.8  # of the heap-served activations glibc keeps resident ...
CPU_HEAP_KEPT_WEIGHTS = 10  # ... up to this many times the largest weight
CPU_RECOMPUTE_KEPT = 0.25  # of the activations checkpointing recomputes in backward, the heap glibc keeps around them
CPU_BASELINE = ("params_mb", "data_mb", "ema_mb")  # in the RSS at MemoryMonitor.start: not counted on CPU
# A graphed step (CUDA only) holds, beyond the eager step, terms not yet fitted on a GPU (docs/memory.md): its private
# pool, a share of the eager step's peak (the eager warm-up steps' blocks stay cached in the allocator, which the pool
# does not reuse) ...
GRAPH_POOL_STEP = 1.0
# ... parameter-sized blocks, in units of the parameters (the excess of the graphed runs measured on an H200 followed
# the parameters more than the activations: 4.5-15x the parameters against 0.8-6.6x the step's peak) ...
GRAPH_WARMUP_KEPT = 4.0
# ... and the capturable optimizer's device scalars: a ``step`` per parameter tensor and a learning rate per group, each
# one block of the CUDA allocator's smallest size
CAPTURABLE_BLOCK = 512
GRAPHED = ("graph_pool_mb", "warmup_kept_mb", "capturable_mb")  # the prediction's graphed-step terms


@dataclass(frozen=True)
class Footprint:
    """What a replayed training micro-step measures, in bytes.

    ``peak`` is the most the replay's ops held at once (input, activations, AMP copies, gradients,
    temporaries); parameters, buffers and optimizer state exist before it and are not in it.
    """

    params: int
    buffers: int
    largest_param: int
    activations: int
    largest_activation: int
    heap_activations: int  # saved storages below GLIBC_MMAP_CEILING: served from glibc's heap on CPU
    amp_copies: int
    peak: int
    param_tensors: int = 0  # how many: a graphed step's capturable optimizer keeps a device scalar for each
    recomputed: int = 0  # the activations checkpointing does not save: recomputed in backward


class LiveBytes(TorchDispatchMode):
    """Within its context, the bytes of the storages that ops create, each counted until freed, and their peak.

    A storage an op receives before any op made it (a parameter, an optimizer state) existed before and
    does not count, also when an in-place op hands it back.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._seen.update(t.untyped_storage() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self._seen:
                storage = t.untyped_storage()
                self._seen.add(storage)
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _nbytes(tensors) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


def _is_weight_cast(t: torch.Tensor) -> bool:
    """A cast of a parameter: autograd records it as ``ToCopyBackward0`` straight onto the parameter."""
    node = t.grad_fn
    return type(node).__name__ == "ToCopyBackward0" and isinstance(
        getattr(node.next_functions[0][0], "variable", None), nn.Parameter
    )


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Within its context, the bytes of each storage autograd saves for backward, counted once.

    Storages of ``exclude`` (parameters, buffers, the input) and casts of parameters are skipped. Storages
    are told apart by ``id``, which is safe because every saved storage stays alive until backward.
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self._exclude = {id(t.untyped_storage()) for t in exclude}
        self._saved: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in self._exclude and not _is_weight_cast(t):
            self._saved[id(storage)] = storage.nbytes()
        return t

    @property
    def sizes(self) -> list[int]:
        return list(self._saved.values())


class WeightCasts(TorchDispatchMode):
    """Within its context, the bytes of the casts made of ``params``, one per parameter (autocast caches
    its casts of parameters until it exits, also those made inside a checkpointed segment)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self._params = {id(p.untyped_storage()) for p in params}
        self._casts: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = id(args[0].untyped_storage()) if func is torch.ops.aten._to_copy.default else None
        if source in self._params:
            self._casts[source] = out.untyped_storage().nbytes()
        return out

    @property
    def nbytes(self) -> int:
        return sum(self._casts.values())


def _batch(data: DataConfig, batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A gathered uint8 batch, its float input (``to_input``) and labels, as ``Trainer`` makes them."""
    images = torch.empty(batch_size, data.in_channels, *[data.size] * 3, dtype=torch.uint8, device=device)
    return images, to_input(images), torch.zeros(batch_size, dtype=torch.long, device=device)


@cachetools.cached(
    cachetools.LRUCache(maxsize=16),
    key=lambda cfg, execution, batch_size: repr(
        (cfg.model, cfg.data, execution.autocast, min(cfg.accumulate, 2), execution.device, batch_size)
    ),
)
def footprint(cfg: Config, execution: Execution, batch_size: int) -> Footprint:
    """Replay a training micro-step of ``cfg`` at ``batch_size`` on fake tensors of ``execution``'s device, in its
    compute dtype (once per process for each model, data, precision, accumulation and batch: a sweep's later jobs
    reuse it).

    The saved tensors are recorded in a forward of their own: hooks that return the tensor they pack tie
    it to its own graph node, which would keep memory alive in the replay that tracks the peak. With
    ``accumulate > 1`` that replay runs a second micro-step, with the accumulated gradients held.
    """
    data, dtype, device = cfg.data, execution.autocast, execution.device
    autocast = functools.partial(torch.autocast, device.type, dtype=dtype, enabled=dtype is not None)
    activation_gain(cfg.model.activation)  # computed (and cached) for real: it reads a value
    with FakeTensorMode():
        with torch.device(device):
            model = build_model(cfg.model, data).train()
        _, x, labels = _batch(data, batch_size, device)
        saved = SavedTensors([*model.parameters(), *model.buffers(), x])
        with autocast(), saved, WeightCasts(list(model.parameters())) as casts:
            F.cross_entropy(model(x), labels)
        recomputed = _recomputed(model, x, labels, autocast, sum(saved.sizes))
        with LiveBytes() as live:
            for _ in range(min(cfg.accumulate, 2)):
                images, x, labels = _batch(data, batch_size, device)  # the uint8 batch stays referenced, as in training
                with autocast():
                    F.cross_entropy(model(x), labels).backward()
        params = _nbytes(model.parameters())
        return Footprint(
            sum(params),
            sum(_nbytes(model.buffers())),
            max(params),
            sum(saved.sizes),
            max(saved.sizes),
            sum(size for size in saved.sizes if size < GLIBC_MMAP_CEILING),
            casts.nbytes,
            live.peak,
            len(params),
            recomputed,
        )


def _recomputed(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, autocast, saved: int) -> int:
    """The bytes of the activations a checkpointed ``model`` does not save but recomputes in backward: what a forward
    with its checkpointing off saves beyond the ``saved`` bytes of one with it on; 0 where no module checkpoints."""
    checked = [module for module in model.modules() if getattr(module, "checkpointing", False)]
    if not checked:
        return 0
    for module in checked:
        module.checkpointing = False
    try:
        unchecked = SavedTensors([*model.parameters(), *model.buffers(), x])
        with autocast(), unchecked:
            F.cross_entropy(model(x), labels)
        return sum(unchecked.sizes) - saved
    finally:
        for module in checked:
            module.checkpointing = True


def optimizer_state_factor(cfg: OptimConfig) -> int:
    """Optimizer state in units of the parameters: SGD 0 without momentum, 1 with; Adam, AdamW 2."""
    if cfg.name is OptimName.sgd:
        return int(cfg.momentum != 0)
    return 2


def step_temporaries(cfg: OptimConfig, device: torch.device, fp: Footprint) -> int:
    """Peak temporaries of ``optimizer.step()``.

    CUDA runs the foreach kernels over all parameters at once: one parameter-sized list (Adam's
    ``sqrt(v)``; SGD's weight-decayed gradients). CPU loops over parameters, so only the largest counts:
    Adam's ``sqrt(v)`` and its quotient, plus the L2-decayed gradient; SGD's decayed and Nesterov gradients.
    The fused kernels (``optim.fused``) update in place and need none.
    """
    if cfg.fused:
        return 0
    decay = cfg.weight_decay != 0
    if device.type == "cuda":
        return fp.params * (decay if cfg.name is OptimName.sgd else 1)
    if cfg.name is OptimName.sgd:
        return fp.largest_param * (decay + (cfg.nesterov and cfg.momentum != 0))
    return fp.largest_param * (2 + (decay and cfg.name is OptimName.adam))


def dataset_bytes(cfg: DataConfig) -> int:
    """All three splits as ``data.loader=tensor`` holds them: uint8 images and int64 labels."""
    return sum(split_sizes(cfg).values()) * (cfg.in_channels * cfg.size**3 + 8)


def input_bytes(cfg: DataConfig, batch_size: int) -> int:
    """A training batch: the uint8 gather, its float32 copy (``to_input``) and the int64 labels."""
    return batch_size * (5 * cfg.in_channels * cfg.size**3 + 8)


def static_input_bytes(cfg: Config, batch_size: int) -> int:
    """A graphed step's static copies of its ``accumulate`` micro-batches (``GraphedStep``): float32 images and int64
    labels, held for the run."""
    return cfg.accumulate * batch_size * (4 * cfg.data.in_channels * cfg.data.size**3 + 8)


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted ``mem/peak_mb`` of a run and its components, in MiB; ``total_mb`` sums what ``device`` counts.

    ``step``: the step predicted, ``eager`` or ``graphed`` (the run's :class:`~src.execution.Execution`). ``params_mb``,
    ``data_mb`` and ``ema_mb`` count on CUDA only (on CPU they are in ``MemoryMonitor``'s baseline); ``data_mb`` is 0
    unless ``data.loader=tensor``; ``best_weights_mb`` is the copy of the best weights ``fit`` holds from the second
    epoch on (0 for one epoch), ``ema_mb`` the averaged copy ``ema_decay`` keeps; ``static_inputs_mb`` a graphed step's
    static batches, ``graph_pool_mb`` its private pool, ``warmup_kept_mb`` the parameter-sized blocks its eager warm-up
    steps leave, ``capturable_mb`` its optimizer's device scalars (:func:`graphed_terms`: a structure not yet fitted on
    a GPU, docs/memory.md); all four are 0 for an eager step.
    """

    device: str
    step: str
    batch_size: int
    params_mb: float
    data_mb: float
    gradients_mb: float
    optimizer_mb: float
    amp_copies_mb: float
    activations_mb: float
    input_mb: float
    best_weights_mb: float
    ema_mb: float
    static_inputs_mb: float
    graph_pool_mb: float
    warmup_kept_mb: float
    capturable_mb: float
    transients_mb: float
    workspace_mb: float
    total_mb: float

    def counted(self) -> dict[str, bool]:
        """Which components ``total_mb`` includes on this device."""
        return {
            f.name: self.device == "cuda" or f.name not in CPU_BASELINE
            for f in dataclasses.fields(self)
            if f.name.endswith("_mb") and f.name != "total_mb"
        }

    def table(self) -> str:
        """A printable breakdown; components in the baseline (not counted) are marked."""
        title = f"predicted peak memory on {self.device}, batch {self.batch_size}, {self.step} step"
        rows = [title, f"  {'component':<14} {'MiB':>10}"]
        for name, counted in self.counted().items():
            note = "" if counted else "  (in the CPU baseline: not counted)"
            rows.append(f"  {name[:-3]:<14} {getattr(self, name):>10.1f}{note}")
        rows.append(f"  {'total':<14} {self.total_mb:>10.1f}")
        return "\n".join(rows)


def cpu_workspace(fp: Footprint, threads: int) -> float:
    """Bytes a CPU run holds beyond its live tensors (docs/memory.md): a fixed part, one weight-gradient
    scratchpad of the largest weight per thread, oneDNN's copies of the largest activation, the freed heap glibc
    keeps where heap-served activations alternate with weight-sized blocks (bounded by the weights' size), and the
    freed heap it keeps around the activations a checkpointed step recomputes. ``threads``: each rank's
    (:class:`~src.execution.Execution`)."""
    copies = CPU_LARGEST_COPIES * min(fp.largest_activation, CPU_COPIED_MB * MIB)
    kept = CPU_HEAP_KEPT * min(fp.heap_activations, CPU_HEAP_KEPT_WEIGHTS * fp.largest_param)
    recomputed = CPU_RECOMPUTE_KEPT * fp.recomputed
    return CPU_FIXED_MB * MIB + threads * fp.largest_param + copies + kept + recomputed


def graphed_terms(fp: Footprint, step_peak: int) -> dict[str, int]:
    """Bytes a graphed step holds beyond the eager one, each a named term with its coefficient: the graph's private
    pool (:data:`GRAPH_POOL_STEP` x the eager step's ``step_peak``: input, activations, AMP copies, gradients,
    temporaries), parameter-sized blocks the eager warm-up steps leave allocated (:data:`GRAPH_WARMUP_KEPT` x the
    parameters) and the capturable optimizer's device scalars (a ``step`` per parameter tensor, a learning rate per
    group: :data:`CAPTURABLE_BLOCK` each). Not yet fitted on a GPU (docs/memory.md)."""
    return {
        "graph_pool_mb": round(GRAPH_POOL_STEP * step_peak),
        "warmup_kept_mb": round(GRAPH_WARMUP_KEPT * fp.params),
        "capturable_mb": CAPTURABLE_BLOCK * (fp.param_tensors + 1),  # graphed: Adam or AdamW, one param group
    }


def predict(cfg: Config, execution: Execution, batch_size: int | None = None) -> MemoryPrediction:
    """Predict ``mem/peak_mb`` of training ``cfg`` as ``execution`` runs its step, at ``batch_size`` (default
    ``cfg.batch_size``).

    Raises:
        UsageError: no batch size to predict for (``batch_size=auto`` and none given).
    """
    batch = batch_size or cfg.batch_size
    if not isinstance(batch, int):
        raise UsageError(f"batch_size={batch} has no size to predict for: give batch_size=<n>")
    device = execution.device
    fp = footprint(cfg, execution, batch)
    batch_in = input_bytes(cfg.data, batch)
    peak = max(fp.peak, fp.params + step_temporaries(cfg.optim, device, fp))
    parts = {
        "params_mb": fp.params,
        "data_mb": dataset_bytes(cfg.data) if cfg.data.loader is Loader.tensor else 0,
        "gradients_mb": fp.params,
        "optimizer_mb": optimizer_state_factor(cfg.optim) * fp.params,
        "amp_copies_mb": fp.amp_copies,
        "activations_mb": fp.activations,
        "input_mb": batch_in,
        "best_weights_mb": fp.params + fp.buffers if cfg.epochs > 1 else 0,
        "ema_mb": fp.params + fp.buffers if cfg.ema_decay is not None else 0,
        "static_inputs_mb": static_input_bytes(cfg, batch) if execution.graphed else 0,
        **(graphed_terms(fp, peak) if execution.graphed else dict.fromkeys(GRAPHED, 0)),
        "transients_mb": max(0, peak - fp.params - fp.amp_copies - fp.activations - batch_in),
        "workspace_mb": cpu_workspace(fp, execution.threads) if device.type == "cpu" else 0,
    }
    parts = {name: value / MIB for name, value in parts.items()}
    total = sum(value for name, value in parts.items() if device.type == "cuda" or name not in CPU_BASELINE)
    step = "graphed" if execution.graphed else "eager"
    return MemoryPrediction(device.type, step, batch, **parts, total_mb=total)
