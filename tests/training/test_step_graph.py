"""``cuda_graphs``: where a step can be captured, and a graphed trainer's steps on the CPU through the stand-in
capture of :func:`tests.helpers.graph_on_cpu` (the real CUDA graph: ``tests/training/test_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.resolve import resolve_cuda_graphs
from src.training.step_graph import WARMUP_STEPS
from tests.helpers import compose_config, graph_on_cpu
from tests.training.test_engine import trainer_for

CUDA = torch.device("cuda")  # only named: graph_blocker reads no CUDA state for these configs


def config(*overrides: str):
    return OmegaConf.to_object(compose_config(*overrides))


@pytest.mark.parametrize(
    "overrides,because",
    [
        ((), None),
        (("amp=true", "amp_dtype=bfloat16", "ema_decay=0.99", "grad_clip=1", "accumulate=2", "sched=cyclic"), None),
        (("compile=true",), "compile=true"),
        (("parallel=ddp",), "parallel=ddp"),
        (("parallel=dp",), "parallel=dp"),
        (("amp=true", "amp_dtype=float16"), "float16 autocast"),
        (("optim=sgd",), "optim=sgd"),
        (("model.checkpointing=true",), "model.checkpointing"),
    ],
)
def test_auto_graphs_a_cuda_step_unless_something_in_it_cannot_be_captured(overrides, because):
    graphed, why = resolve_cuda_graphs(config(*overrides), CUDA)
    assert graphed == (because is None) and why.startswith(because or "")
    if because is not None:
        with pytest.raises(UsageError, match=f"^cuda_graphs=true cannot run here: {because}.*; use cuda_graphs=auto"):
            resolve_cuda_graphs(config(*overrides, "cuda_graphs=true"), CUDA)
    assert resolve_cuda_graphs(config(*overrides, "cuda_graphs=false"), CUDA) == (False, "cuda_graphs=false")


def test_on_the_cpu_auto_steps_eagerly_and_true_is_refused():
    cpu = torch.device("cpu")
    assert resolve_cuda_graphs(config(), cpu) == (False, "CUDA graphs need a CUDA device (this run is on cpu)")
    with pytest.raises(UsageError, match="^cuda_graphs=true cannot run here: CUDA graphs need a CUDA device"):
        resolve_cuda_graphs(config("cuda_graphs=true"), cpu)


@pytest.mark.parametrize(
    "switches",
    [
        (),
        ("accumulate=2",),
        ("ema_decay=0.9",),
        ("grad_clip=0.05",),
        ("sched=cyclic",),
        ("warmup_epochs=1",),
        ("amp=true",),
    ],
)
def test_a_graphed_trainer_trains_as_the_eager_one(shared_data, switches):
    """Same losses and weights (the learning rate a float32 tensor: to 1e-5); one capture for the whole run, whose
    learning-rate tensor the schedule fills in place."""
    run = ("batch_size=4", "limit_batches=8", "epochs=3", "optim.lr=0.01", *switches)
    eager = trainer_for(*run, data_root=shared_data)
    graphed = graph_on_cpu(trainer_for(*run, data_root=shared_data))
    lr = graphed.optimizer.param_groups[0]["lr"]
    for epoch in range(3):
        expected, got = eager.train_epoch(epoch), graphed.train_epoch(epoch)
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5)
        assert got["train/acc"] == expected["train/acc"]
        assert lr.item() == pytest.approx(eager.optimizer.param_groups[0]["lr"], rel=1e-6)
    assert graphed.optimizer.param_groups[0]["lr"] is lr and graphed.captures == 1
    assert graphed.step_graph.warm_steps == WARMUP_STEPS
    for name, value in eager.evaluated.state_dict().items():
        torch.testing.assert_close(graphed.evaluated.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    if graphed.ema is not None:
        assert graphed.ema.updates == eager.ema.updates == 3 * graphed.steps_per_epoch


def test_each_step_stages_its_own_batch_into_the_static_tensors(shared_data):
    trainer = graph_on_cpu(trainer_for("batch_size=4", "limit_batches=5", data_root=shared_data))
    seen = []
    body = trainer.step_graph.body
    trainer.step_graph.body = lambda batches: seen.append(batches[0][0].clone()) or body(batches)
    trainer.train_epoch(0)
    images = [trainer.train_batch(batch, 0, i)[0] for i, batch in zip(range(5), trainer.loaders["train"], strict=False)]
    assert len(seen) == 5 and all(torch.equal(a, b) for a, b in zip(seen, images, strict=True))
