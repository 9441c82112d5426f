"""src/training/step_graph.py: a graphed trainer on the CPU through the stand-in capture of
:func:`tests.helpers.graph_on_cpu` (the real CUDA graph: ``tests/training/test_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

from src.training.step_graph import WARMUP_STEPS
from tests.helpers import graph_on_cpu
from tests.training.helpers import trainer_for


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


def test_a_graphed_run_does_not_time_the_steps_before_and_of_its_capture(shared_data):
    """The graph's eager steps and the step that captures it (``WARMUP_STEPS + 1``) stay out of the first epoch's
    timing; later epochs leave out one step, as eager runs do."""
    trainer = graph_on_cpu(trainer_for("batch_size=4", "limit_batches=8", "epochs=2", data_root=shared_data))
    for epoch in range(2):
        trainer.train_epoch(epoch)
    timed = [epoch["perf/steps_timed"] for epoch in trainer.timed]
    assert timed == [8 - (WARMUP_STEPS + 1), 8 - 1] and trainer.captures == 1
