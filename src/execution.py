"""How a job's steps execute on this machine, decided once: :class:`Execution`, resolved from the config and the
machine when the job is planned and read by every part that depends on it (the trainer, the memory predictor, the
dry run's timing, MFU, the run's tags, through them the report). Nothing else decides the device, the compute
dtype, CUDA graphs, the DDP backend, the threads or whether the job may train fused with others of its sweep; a
decision that cannot run here raises :class:`UsageError` before any work starts. docs/architecture.md."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from src.config import AmpDtype, Backend, Config, Device, OptimName, ParallelMode
from src.errors import UsageError
from src.models import check_model
from src.parallel import dist
from src.parallel.launch import gpus_per_job
from src.parallel.machine_share import jobs_at_once


@dataclass(frozen=True)
class Execution:
    """One job's execution: where (``device``: the job's first device; a rank's own: :meth:`on`), in what dtype and
    why, whether each optimizer step replays as one CUDA graph and if not why, the DDP process group's backend (None
    without ``parallel=ddp``), the job's ranks on this node and each one's CPU threads, the memory format and
    activation recomputation."""

    device: torch.device
    dtype: torch.dtype  # the step's compute dtype: autocast's, or float32
    dtype_because: str
    graphed: bool
    eager_because: str  # "" when graphed
    backend: str | None
    ranks_on_node: int  # the job's ranks sharing this node's cores and memory
    threads: int
    channels_last: bool
    checkpointing: bool
    fuse: bool = False  # the job may train fused with same-shape jobs of its sweep (docs/fused.md)
    alone_because: str = "fuse=false"  # why it trains alone ("" where it may fuse)

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype the step autocasts to; None for float32 (``amp=false``, or AMP resolved to float32)."""
        return None if self.dtype == torch.float32 else self.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last_3d if self.channels_last else torch.contiguous_format

    def on(self, device: torch.device) -> Execution:
        """The same execution on another device of the job (a rank's GPU)."""
        return dataclasses.replace(self, device=device)

    def alone(self, because: str) -> Execution:
        """The same execution training the job by itself, and why (its sweep gave it no group: docs/fused.md)."""
        return dataclasses.replace(self, fuse=False, alone_because=because)

    def tags(self) -> dict[str, str]:
        """The run's tags that record it: ``amp.dtype``, ``device``, ``num_threads``, ``cuda_graphs`` and, for eager
        steps, ``cuda_graphs.eager_because``; ``fuse=false`` and ``fuse.alone_because`` for a job that trains by itself
        (a member of a fused group: ``fuse=true`` and its group, tagged by :mod:`src.jobs.fuse`)."""
        graphs = {"cuda_graphs": "true"} if self.graphed else {"cuda_graphs": "false"}
        if not self.graphed:
            graphs["cuda_graphs.eager_because"] = self.eager_because
        fused = {"fuse": "true"} if self.fuse else {"fuse": "false", "fuse.alone_because": self.alone_because}
        return {
            "amp.dtype": self.dtype_name,
            "device": str(self.device),
            "num_threads": str(self.threads),
            **graphs,
            **fused,
        }


def validate(
    cfg: DictConfig, external: dist.Rank | None = None, resumed_threads: int | None = None
) -> tuple[Config, Execution]:
    """The typed config, its model checked against the zoo, and its :func:`resolve`d execution."""
    try:
        typed: Config = OmegaConf.to_object(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_model(typed.model)
    return typed, resolve(typed, external, resumed_threads)


def resolve(cfg: Config, external: dist.Rank | None = None, resumed_threads: int | None = None) -> Execution:
    """``cfg``'s execution on this machine; ``external``: the rank torchrun or SLURM started this process as;
    ``resumed_threads``: the threads of the run it goes on with (results change with the thread count)."""
    device = resolve_device(cfg)
    dtype, dtype_because = compute_dtype(cfg, device)
    check_parallel(cfg, device)
    graphed, eager_because = cuda_graphs(cfg, device, dtype)
    fuse, alone_because = fusing(cfg, device)
    ranks = ranks_on_node(cfg, device, external)
    return Execution(
        device=device,
        dtype=dtype,
        dtype_because=dtype_because,
        graphed=graphed,
        eager_because=eager_because,
        backend=ddp_backend(cfg, device) if cfg.parallel.mode is ParallelMode.ddp else None,
        ranks_on_node=ranks,
        threads=cfg.num_threads or resumed_threads or thread_count(ranks),
        channels_last=cfg.channels_last,
        checkpointing=cfg.model.checkpointing,
        fuse=fuse,
        alone_because=alone_because,
    )


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device is Device.cuda and not torch.cuda.is_available():
        raise UsageError("device=cuda but no CUDA device is visible: use device=auto or device=cpu")
    if cfg.device is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 natively (avx512_bf16 or AMX). Elsewhere bf16 convolutions are emulated:
    ~100x slower than float32 on an AVX2-only AMD EPYC, 0.33-0.44x on an Intel Xeon with AVX-512 but no
    avx512_bf16, where oneDNN still calls bf16 supported (docs/benchmarks.md)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def amp_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype ``amp=true`` autocasts to. ``auto``: on CUDA bfloat16 where the GPU computes it natively (compute
    capability 8.0 on: no GradScaler), else float16 (with one); on CPU bfloat16 where it is native, else float32
    (autocast would only slow the run down). float16 on CPU is refused (no fp16 units, ~50x slower)."""
    if cfg.amp_dtype is AmpDtype.auto:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if cfg.amp_dtype is AmpDtype.float16 and device.type != "cuda":
        raise UsageError("amp_dtype=float16 needs a CUDA device (this run is on cpu): use amp_dtype=bfloat16 or auto")
    return getattr(torch, cfg.amp_dtype.value)


def compute_dtype(cfg: Config, device: torch.device) -> tuple[torch.dtype, str]:
    """What the step computes in, and why."""
    dtype = amp_dtype(cfg, device)  # amp=false checks amp_dtype too: a sweep's amp=false jobs refuse what amp=true's do
    if not cfg.amp:
        return torch.float32, "amp=false"
    if dtype == torch.float32:
        return dtype, (
            "amp=true: this CPU has no native bf16 (avx512_bf16/AMX), where autocast emulates it, 2-3x slower with "
            "AVX-512, ~100x with AVX2 only; training in float32 (amp_dtype=bfloat16 forces it)"
        )
    return dtype, f"amp=true, amp_dtype={cfg.amp_dtype.value} on {device.type}"


def cuda_graphs(cfg: Config, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether each optimizer step replays as one CUDA graph, and if not, why. ``auto``: where nothing in the step
    stops a capture; ``true``: there, or a :class:`UsageError`; ``false``: never."""
    if cfg.cuda_graphs is False:
        return False, "cuda_graphs=false"
    blocker = graph_blocker(cfg, device, dtype)
    if blocker is None:
        return True, ""
    if cfg.cuda_graphs is True:
        raise UsageError(f"cuda_graphs=true cannot run here: {blocker}; use cuda_graphs=auto or false")
    return False, blocker


def graph_blocker(cfg: Config, device: torch.device, dtype: torch.dtype) -> str | None:
    """What in the config keeps its step from being captured: the first found, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this run is on {device.type})"
    blockers = {
        "compile=true (torch.compile captures graphs of its own)": cfg.compile,
        "parallel=dp (a thread per GPU)": cfg.parallel.mode is ParallelMode.dp,
        "parallel=ddp (capture with DDP is not measured yet)": cfg.parallel.mode is ParallelMode.ddp,
        "float16 autocast (its GradScaler checks for inf on the host each step)": dtype == torch.float16,
        "optim=sgd (captured only with adam and adamw yet)": cfg.optim.name is OptimName.sgd,
        "model.checkpointing (recomputation under capture is not measured yet)": cfg.model.checkpointing,
    }
    return next((blocker for blocker, found in blockers.items() if found), None)


def fusing(cfg: Config, device: torch.device) -> tuple[bool, str]:
    """Whether the job may train fused with the same-shape jobs of its sweep, and if not, why. ``auto``: on CUDA,
    where nothing in the step keeps it apart (on the CPU a stacked step does the work of its members one after another
    on the same cores: nothing to gain); ``true``: there, on the CPU too, or a :class:`UsageError`; ``false``: never.
    Which jobs fuse, and a group's own limits, :mod:`src.jobs.fuse` decides from the sweep's jobs."""
    if cfg.fuse is False:
        return False, "fuse=false"
    blocker = fuse_blocker(cfg)
    if blocker is None and (cfg.fuse is True or device.type == "cuda"):
        return True, ""
    if cfg.fuse is True:
        raise UsageError(f"fuse=true cannot run here: {blocker}; use fuse=auto or false")
    return False, blocker or (
        "fuse=auto fuses on CUDA only: on the CPU a fused step does its members' work one after another on the same "
        "cores (fuse=true fuses here too)"
    )


def fuse_blocker(cfg: Config) -> str | None:
    """What in the config keeps the job from training as a member of a stacked model: the first found, or None."""
    blockers = {
        "parallel=ddp or dp (a fused group trains in one process on one device)": cfg.parallel.mode
        is not ParallelMode.none,
        "compile=true (torch.compile of a vmapped step is not measured yet)": cfg.compile,
        "model.checkpointing (recomputation under vmap is not measured yet)": cfg.model.checkpointing,
        "channels_last (the stacked step runs in the contiguous format)": cfg.channels_last,
        "oom_retry (a group cannot halve one member's micro-batch)": cfg.oom_retry,
        "batch_size=auto (its probe fits one job in memory, not a group)": cfg.batch_size == "auto",
        "mem_budget_mb (a job's budget, not a group's: a group's memory is not planned yet)": cfg.mem_budget_mb
        is not None,
        "fault.* (test faults act on a job's own process)": cfg.fault.kill_rank is not None
        or cfg.fault.term_step is not None
        or cfg.fault.oom_step is not None,
    }
    return next((blocker for blocker, found in blockers.items() if found), None)


def ddp_backend(cfg: Config, device: torch.device) -> str:
    """``auto``: NCCL on CUDA, gloo on CPU; NCCL without CUDA is refused."""
    if cfg.parallel.backend is Backend.auto:
        return "nccl" if device.type == "cuda" else "gloo"
    if cfg.parallel.backend is Backend.nccl and device.type != "cuda":
        raise UsageError(
            "parallel.backend=nccl needs CUDA devices (this run is on cpu): use parallel.backend=gloo or auto"
        )
    return cfg.parallel.backend.value


def check_parallel(cfg: Config, device: torch.device) -> None:
    """Parallel settings that cannot work here fail before any work starts."""
    if cfg.parallel.mode is ParallelMode.dp and (device.type != "cuda" or torch.cuda.device_count() < 2):
        found = torch.cuda.device_count() if device.type == "cuda" else 0
        raise UsageError(
            f"parallel=dp needs 2 or more visible GPUs (found {found}): use parallel=ddp, "
            f"or parallel=none on one device"
        )
    if cfg.parallel.mode is ParallelMode.ddp:
        chosen = ddp_backend(cfg, device)
        if cfg.parallel.sync_bn and chosen != "nccl":
            raise UsageError(
                f"parallel.sync_bn=true needs NCCL on CUDA (SyncBatchNorm has no {chosen} CPU kernel): "
                f"use parallel.sync_bn=false, or model.norm=group"
            )
        if device.type == "cuda" and (cfg.parallel.nproc or 0) > torch.cuda.device_count():
            raise UsageError(
                f"parallel.nproc={cfg.parallel.nproc} exceeds the {torch.cuda.device_count()} visible "
                f"GPUs: lower parallel.nproc"
            )


def ranks_on_node(cfg: Config, device: torch.device, external: dist.Rank | None = None) -> int:
    """The job's ranks sharing this node's cores: torchrun's ``LOCAL_WORLD_SIZE``, else the rank count of a job
    torchrun / SLURM started, else the ranks ``parallel=ddp`` spawns, else 1."""
    if (local := dist.env_count("LOCAL_WORLD_SIZE", 1)) is not None:
        return local
    if external is not None:
        return external.world
    if cfg.parallel.mode is not ParallelMode.ddp:
        return 1
    return dist.world_size(cfg, tuple(range(gpus_per_job(device))))


def thread_count(ranks_on_node: int = 1) -> int:
    """A rank's CPU threads where ``num_threads`` is null: this process's cores shared by the ranks on its node and
    by the jobs of its sweep running at once on this machine."""
    return max(1, len(os.sched_getaffinity(0)) // (ranks_on_node * jobs_at_once()))
