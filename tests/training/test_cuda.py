"""On a CUDA device (marker ``gpu``, skipped without one): the precision ``amp_dtype=auto`` picks there, and the
optimizer step replayed as one CUDA graph (``cuda_graphs``): equal to the eager step, no host sync inside, resumed
bitwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from src.config import Config
from src.data.loaders import load_splits, make_loader
from src.execution import amp_dtype, resolve
from src.parallel.dist import Rank
from src.parallel.preemption import Preempted, Preemption
from src.parallel.ranks import seed_everything
from src.training import checkpoint
from src.training.build import build_trainer
from src.training.faults import fault_hooks
from src.training.optim import Precision
from src.training.step_graph import WARMUP_STEPS
from src.training.trainer import Hooks, Trainer
from tests.helpers import compose_config

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def nondeterministic_after():
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def cuda_config(shared_data: Path, *overrides: str) -> Config:
    """A short CUDA run on the shipped AdrenalMNIST3D, seeded."""
    cfg = OmegaConf.to_object(
        compose_config(
            "data=adrenalmnist3d",
            f"data.root={shared_data}",
            "data.download=false",
            "device=cuda",
            "batch_size=8",
            "limit_batches=8",
            *overrides,
        )
    )
    seed_everything(cfg, resolve(cfg).threads)
    return cfg


def cuda_trainer(shared_data: Path, *overrides: str, hooks: Hooks | None = None) -> Trainer:
    cfg = cuda_config(shared_data, "model=resnet10", "epochs=2", *overrides)
    return build_trainer(cfg, resolve(cfg), hooks=hooks)


def test_amp_auto_is_bfloat16_without_a_scaler_where_the_gpu_computes_it_natively():
    cfg = OmegaConf.to_object(compose_config("amp=true"))
    dtype = amp_dtype(cfg, CUDA)
    assert dtype == (torch.bfloat16 if torch.cuda.get_device_capability(CUDA)[0] >= 8 else torch.float16)
    assert Precision.build(dtype, CUDA).scaler.is_enabled() == (dtype == torch.float16)


@pytest.mark.parametrize("switches", [(), ("accumulate=2", "ema_decay=0.9", "grad_clip=1", "sched=cyclic")])
def test_graphed_float32_steps_equal_the_eager_ones(shared_data, switches):
    """On a net whose CUDA kernels are all deterministic: with the zoo's pooling backward two eager runs differ too
    (Adam turns its varying roundings into other weights within an epoch; docs/gpu.md)."""
    eager = deterministic_trainer(shared_data, "cuda_graphs=false", "epochs=2", *switches)
    graphed = deterministic_trainer(shared_data, "cuda_graphs=true", "epochs=2", *switches)
    assert eager.step_graph is None and graphed.step_graph is not None
    for epoch in range(2):
        expected, got = eager.train_epoch(epoch), graphed.train_epoch(epoch)
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5)
    assert graphed.step_graph.replay is not None
    for name, value in eager.evaluated.state_dict().items():
        torch.testing.assert_close(graphed.evaluated.state_dict()[name], value, rtol=1e-4, atol=1e-5)


def test_a_graphed_step_makes_no_host_sync(shared_data):
    trainer = cuda_trainer(shared_data, "amp=true", "ema_decay=0.9", "sched=cyclic")
    trainer.model.train()
    batch = trainer.train_batch(next(iter(trainer.loaders["train"])), 0, 0)
    for _ in range(WARMUP_STEPS + 1):  # the warm-up steps, then the capture and its first replay
        trainer.step_graph([batch])
        trainer._count_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            trainer.step_graph([batch])
            trainer._count_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(trainer.step_graph.loss).item()


def test_auto_graphs_the_default_bf16_run_and_it_trains(shared_data):
    trainer = cuda_trainer(shared_data, "amp=true")
    assert trainer.step_graph is not None and trainer.execution.eager_because == ""
    losses = [trainer.train_epoch(epoch)["train/loss"] for epoch in range(2)]
    assert all(loss == loss for loss in losses)  # not NaN


def deterministic_net() -> nn.Module:
    """The zoo's max-pool and adaptive-pool backward have no deterministic CUDA kernel; this net's layers all do."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 8, 3, stride=2), nn.BatchNorm3d(8), nn.ReLU(), GlobalMean(), nn.Linear(8, 2)).to(
        CUDA
    )


class GlobalMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3, 4))


def deterministic_trainer(shared_data: Path, *overrides: str, hooks: Hooks | None = None) -> Trainer:
    cfg = cuda_config(shared_data, "deterministic=true", *overrides)
    loaders = {
        split: make_loader(cfg.data, tensors, cfg.batch_size, cfg.seed, split == "train", CUDA)
        for split, tensors in load_splits(cfg.data).items()
    }
    hooks = dataclasses.replace(hooks or Hooks(), after_step=fault_hooks(cfg, Rank()))
    return Trainer(cfg, deterministic_net(), loaders, resolve(cfg), Rank(), hooks)


RESUMED_RUN = ("cuda_graphs=true", "accumulate=2", "sched=cyclic", "ema_decay=0.9", "epochs=3")


def test_a_graphed_run_stopped_mid_epoch_resumes_bitwise(tmp_path, shared_data):
    """A real SIGTERM after step 6 of 12 (``fault.term_step``), then the run resumed from its checkpoint."""
    whole = deterministic_trainer(
        shared_data, *RESUMED_RUN, hooks=Hooks(checkpoint_to=tmp_path / "whole" / checkpoint.FILE)
    )
    whole.fit(lambda metrics, step: None)
    parts, preemption = tmp_path / "parts" / checkpoint.FILE, Preemption()
    stopped = deterministic_trainer(
        shared_data, *RESUMED_RUN, "fault.term_step=6", hooks=Hooks(checkpoint_to=parts, preemption=preemption)
    )
    with preemption.installed(), pytest.raises(Preempted, match="stopped at epoch 2 step 2/4"):
        stopped.fit(lambda metrics, step: None)
    resumed = deterministic_trainer(shared_data, *RESUMED_RUN, hooks=Hooks(checkpoint_to=parts))
    resumed.load_state_dict(torch.load(parts, weights_only=True))
    resumed.fit(lambda metrics, step: None)
    expected, got = (torch.load(path, weights_only=True) for path in (tmp_path / "whole" / checkpoint.FILE, parts))
    for part in ("model", "ema"):
        for name, value in expected[part].items():
            assert torch.equal(got[part][name], value), (part, name)


def test_deterministic_trains_the_zoo_on_cuda_with_a_warning(shared_data):
    """Not a failure at the first backward: torch warns about the pooling kernels it runs as they are."""
    trainer = cuda_trainer(shared_data, "deterministic=true", "limit_batches=2", "epochs=1")
    with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
        trainer.train_epoch(0)
