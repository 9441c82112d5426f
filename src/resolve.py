"""A config against this machine: device, compute dtype, parallel settings, CUDA graphs, registered model, split
sizes.

Training and the memory predictor resolve through here; every check raises :class:`UsageError` before any
work starts.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from src.config import AmpDtype, Backend, Config, Device, OptimName, ParallelMode
from src.data import split_sizes
from src.errors import UsageError
from src.models import check_model


def validate(cfg: DictConfig) -> tuple[Config, torch.device]:
    """Every check that needs no data."""
    try:
        typed: Config = OmegaConf.to_object(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_model(typed.model)
    device = resolve_device(typed)
    resolve_amp_dtype(typed, device)
    check_parallel(typed, device)
    resolve_cuda_graphs(typed, device)
    return typed, device


def check_split_sizes(cfg: Config, world: int) -> None:
    need = cfg.batch_size * cfg.accumulate * world
    have = split_sizes(cfg.data)["train"]
    if need > have:
        raise UsageError(
            f"batch_size x accumulate x ranks = {need} exceeds the {have} training samples of "
            f"{cfg.data.name}: lower batch_size or accumulate"
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


def resolve_amp_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``auto``: on CUDA bfloat16 where the GPU computes it natively (compute capability 8.0 on: no GradScaler),
    else float16 (with one); on CPU bfloat16 where it is native, else float32 (autocast would only slow the run down).
    float16 on CPU is refused (no fp16 units, ~50x slower)."""
    if cfg.amp_dtype is AmpDtype.auto:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if cfg.amp_dtype is AmpDtype.float16 and device.type != "cuda":
        raise UsageError("amp_dtype=float16 needs a CUDA device (this run is on cpu): use amp_dtype=bfloat16 or auto")
    return getattr(torch, cfg.amp_dtype.value)


def resolve_cuda_graphs(cfg: Config, device: torch.device) -> tuple[bool, str]:
    """Whether each optimizer step replays as one CUDA graph, and if not, why. ``auto``: where nothing in the step
    stops a capture; ``true``: there, or a :class:`UsageError`; ``false``: never."""
    if cfg.cuda_graphs is False:
        return False, "cuda_graphs=false"
    blocker = graph_blocker(cfg, device)
    if blocker is None:
        return True, ""
    if cfg.cuda_graphs is True:
        raise UsageError(f"cuda_graphs=true cannot run here: {blocker}; use cuda_graphs=auto or false")
    return False, blocker


def graph_blocker(cfg: Config, device: torch.device) -> str | None:
    """What in the config keeps its step from being captured: the first found, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this run is on {device.type})"
    blockers = {
        "compile=true (torch.compile captures graphs of its own)": cfg.compile,
        "parallel=dp (a thread per GPU)": cfg.parallel.mode is ParallelMode.dp,
        "parallel=ddp (capture with DDP is not measured yet)": cfg.parallel.mode is ParallelMode.ddp,
        "float16 autocast (its GradScaler checks for inf on the host each step)": cfg.amp
        and resolve_amp_dtype(cfg, device) == torch.float16,
        "optim=sgd (captured only with adam and adamw yet)": cfg.optim.name is OptimName.sgd,
        "model.checkpointing (recomputation under capture is not measured yet)": cfg.model.checkpointing,
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
