"""src/training/trainer.py: the Trainer's step and evaluation (accumulation, precision, clipping, early stop, throughput
and time parts, divergence), its state resumed bitwise, DDP ranks stopping together."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from medmnist import Evaluator
from torch import nn

from src.data.loaders import load_splits, to_input
from src.parallel.preemption import Preempted, Preemption
from src.training import checkpoint
from src.training.meters import RUN_WARMUP
from src.training.trainer import Hooks, Trainer
from tests.helpers import ROOT, run_cli, runs, small_run
from tests.training.helpers import NOT_RESULTS, assert_same_weights, tiny_net, trainer, trainer_for


def test_trainer_evaluation_matches_evaluator_on_the_model_scores(shared_data):
    trainer = trainer_for("batch_size=50", data_root=shared_data)
    ours = trainer.evaluate("val")
    model = trainer.model.eval()
    images, labels = load_splits(trainer.cfg.data)["val"]
    with torch.no_grad():
        scores = model(to_input(images)).softmax(1).numpy()
    theirs = Evaluator("adrenalmnist3d", "val", root=str(shared_data)).evaluate(scores)
    assert ours["val/acc"] == theirs.ACC
    assert ours["val/auc"] == pytest.approx(theirs.AUC, abs=1e-6)  # batched vs whole forward: float rounding
    assert ours["val/loss"] == pytest.approx(
        nn.functional.cross_entropy(model(to_input(images)), labels).item(), rel=1e-5
    )


def one_step(trainer: Trainer) -> dict[str, torch.Tensor]:
    trainer.train_epoch(0)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_accumulation_equals_the_whole_batch(shared_data):
    sgd = ("optim=sgd", "optim.momentum=0", "optim.weight_decay=0", "sched=none", "optim.lr=0.5")
    split = one_step(trainer_for("batch_size=4", "accumulate=2", "limit_batches=2", *sgd, data_root=shared_data))
    whole = one_step(trainer_for("batch_size=8", "accumulate=1", "limit_batches=1", *sgd, data_root=shared_data))
    untouched = tiny_net().state_dict()
    for name, value in whole.items():
        assert not torch.equal(value, untouched[name]), name  # the step moved every parameter
        torch.testing.assert_close(split[name], value, rtol=1e-4, atol=1e-5)  # float32 summation order


def test_steps_per_epoch_follow_limit_and_accumulation(shared_data):
    trainer = trainer_for("batch_size=16", "accumulate=3", data_root=shared_data)
    assert trainer.steps_per_epoch == (1188 // 16) // 3
    assert trainer_for("batch_size=16", "accumulate=3", "limit_batches=7", data_root=shared_data).steps_per_epoch == 2
    below = trainer_for("batch_size=16", "accumulate=4", "limit_batches=2", data_root=shared_data)
    assert below.steps_per_epoch == 1  # one step, 4 micro-batches, past the cap (docs/configuration.md)


def test_grad_clip_bounds_the_update(shared_data):
    sgd = ("optim=sgd", "optim.momentum=0", "optim.weight_decay=0", "sched=none", "optim.lr=1.0", "limit_batches=1")
    before = tiny_net().state_dict()
    after = one_step(trainer_for("grad_clip=0.001", *sgd, data_root=shared_data))
    change = torch.sqrt(sum(((after[k] - before[k]) ** 2).sum() for k in before))
    assert change.item() == pytest.approx(0.001, rel=1e-3)


def test_bf16_autocast_trains_on_cpu(shared_data):
    trainer = trainer_for("amp=true", "amp_dtype=bfloat16", "limit_batches=2", "batch_size=4", data_root=shared_data)
    context = trainer.precision.autocast()
    assert context.fast_dtype is torch.bfloat16 and context._enabled
    metrics = trainer.train_epoch(0)
    assert not trainer.precision.scaler.is_enabled() and np.isfinite(metrics["train/loss"])


def test_weighted_smoothed_loss_is_torchs(shared_data):
    trainer = trainer_for("class_weights=true", "label_smoothing=0.1", "batch_size=8", data_root=shared_data)
    images, labels = trainer._batch(next(iter(trainer.loaders["train"])))
    loss, _ = trainer.micro_step(images, labels)
    with torch.no_grad():
        expected = nn.functional.cross_entropy(
            trainer.model(images),
            labels,
            label_smoothing=0.1,
            weight=torch.tensor([1188 / (2 * 929), 1188 / (2 * 259)]),
        )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_early_stopping_stops_after_patience_epochs_without_a_better_val_auc(shared_data):
    trainer = trainer_for(
        "early_stop_patience=2", "epochs=10", "limit_batches=1", "batch_size=4", "optim.lr=0", data_root=shared_data
    )  # lr 0: val/auc never improves after epoch 1
    logged = []
    final = trainer.fit(lambda metrics, step: logged.append((step, metrics)))
    assert [step for step, _ in logged] == [0, 1, 2, 10]
    assert final["stopped_epoch"] == 3 and final["best_epoch"] == 1


def test_evaluation_logs_the_clinical_metrics_and_keeps_test_predictions(shared_data):
    trainer = trainer_for("batch_size=50", data_root=shared_data)
    metrics = trainer.evaluate("test")
    assert {"test/balanced_acc", "test/ece", "test/sensitivity", "test/specificity"} <= set(metrics)
    labels, scores = trainer.test_predictions
    assert labels.shape == (298,) and scores.shape == (298, 2)


def test_augmentation_is_seeded_per_step_and_off_in_evaluation(shared_data):
    same, again, other = (
        trainer_for("aug=standard", f"seed={s}", "batch_size=4", data_root=shared_data) for s in (0, 0, 1)
    )
    batch = next(iter(same.loaders["train"]))
    augmented = same.train_batch(batch, epoch=0, micro_step=0)[0]
    assert torch.equal(augmented, again.train_batch(batch, 0, 0)[0])  # same seed: same batches
    assert not torch.equal(augmented, other.train_batch(batch, 0, 0)[0])  # another seed: other batches
    assert not torch.equal(augmented, same.train_batch(batch, 0, 1)[0])  # the next micro-step: other transforms
    assert not torch.equal(augmented, same._batch(batch)[0])
    plain = trainer_for("aug=none", "batch_size=4", data_root=shared_data)
    assert torch.equal(plain.train_batch(batch, 0, 0)[0], plain._batch(batch)[0])  # aug=none: as stored
    assert same.evaluate("val") == plain.evaluate("val")  # equal weights (tiny_net seeds itself): never augmented


def test_evaluation_libraries_are_loaded_before_the_memory_baseline(tmp_path, store, shared_data):
    """In a real job, medmnist and scikit-learn are imported when the CPU memory baseline is taken: loaded at the first
    validation, their ~70 MiB counted in the ``mem/peak_mb`` of a process's first job and in no later job's. The
    command runs with ``MemoryMonitor.start`` wrapped to record what is imported then."""
    spy = f"""
import runpy, sys
from src.training import meters
start = meters.MemoryMonitor.start
def recorded(self):
    print("at the baseline:", sorted({{"medmnist.evaluator", "sklearn.metrics"}} & set(sys.modules)), flush=True)
    start(self)
meters.MemoryMonitor.start = recorded
sys.argv = ["src.train", *{list(small_run(tmp_path, store, shared_data, "epochs=1"))!r}]
runpy.run_module("src.train", run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", spy], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at the baseline: ['medmnist.evaluator', 'sklearn.metrics']" in result.stdout.splitlines()


def test_weights_the_last_step_made_non_finite_fail_as_diverged(shared_data):
    """The train/loss checks see a step's loss before its update: a run whose last step blew the weights up went on
    to validate and test NaN scores and ended FINISHED with test/auc 0."""
    from src.training.trainer import Diverged

    trainer = trainer_for("epochs=1", "limit_batches=1", "batch_size=8", "optim.lr=1e308", data_root=shared_data)
    with pytest.raises(Diverged, match=r"^val/loss is nan after epoch 1$"):
        trainer.fit(lambda metrics, step: None)


def test_a_run_logs_its_epochs_median_range_and_steps_timed_and_keeps_them_across_a_resume(shared_data):
    trainer = trainer_for("epochs=3", "limit_batches=6", "batch_size=4", data_root=shared_data)
    trainer.train_epoch(0)
    trainer.epoch = 1  # as fit leaves it after epoch 1
    resumed = trainer_for("epochs=3", "limit_batches=6", "batch_size=4", data_root=shared_data)
    resumed.load_state_dict(trainer.state_dict())  # a new process: its first epoch skips the warm-up again
    final = resumed.fit(lambda metrics, step: None)
    rates = [epoch["perf/samples_per_s"] for epoch in resumed.timed]
    assert len(rates) == 3 and final["perf/steps_timed"] == 2 * (6 - RUN_WARMUP) + (6 - 1)
    assert final["perf/samples_per_s_median"] == sorted(rates)[1]
    assert (final["perf/samples_per_s_lo"], final["perf/samples_per_s_hi"]) == (min(rates), max(rates))


def test_a_run_states_its_seconds_validating_and_checkpointing_and_keeps_them_across_a_resume(tmp_path, shared_data):
    """Parts of ``time/total_s`` on the main rank: what eager validation and the epochs' checkpoints cost a run."""
    path = tmp_path / "checkpoint.pt"
    first = trainer_for(
        "epochs=2", "limit_batches=3", "batch_size=4", data_root=shared_data, hooks=Hooks(checkpoint_to=path)
    )
    final = first.fit(lambda metrics, step: None)
    assert final["time/validate_s"] > 0 and final["time/checkpoint_s"] > 0
    assert final["time/validate_s"] + final["time/checkpoint_s"] < final["time/total_s"]
    saved = torch.load(path, weights_only=True)["spent_s"]  # written before its own save was counted
    assert saved["time/validate_s"] == final["time/validate_s"]
    assert saved["time/checkpoint_s"] < final["time/checkpoint_s"]
    longer = trainer_for("epochs=3", "limit_batches=3", "batch_size=4", data_root=shared_data)
    longer.load_state_dict(torch.load(path, weights_only=True))
    resumed = longer.fit(lambda metrics, step: None)
    assert resumed["time/validate_s"] > saved["time/validate_s"]


def test_a_loader_batch_that_spans_gpus_counts_whole_in_samples_per_s_and_train_acc(shared_data):
    """parallel=dp: each micro-step trains one loader batch of batch_size x GPUs (build_trainer), all of it counted."""
    trainer = trainer_for("batch_size=4", "limit_batches=5", "epochs=1", data_root=shared_data, width=2)
    metrics = trainer.train_epoch(0)
    assert metrics["perf/samples_per_s"] * metrics["perf/step_ms"] / 1000 == pytest.approx(2 * trainer.cfg.batch_size)
    assert metrics["train/acc"] == trainer.correct.item() / (5 * 2 * trainer.cfg.batch_size) <= 1


def test_ddp_ranks_stop_early_together(tmp_path, store, shared_data):
    """Only rank 0 validates: its early stop is every rank's (rank 1 trained on alone, the run FAILED)."""
    stop = ("epochs=4", "limit_batches=1", "early_stop_patience=1", "optim.lr=0", "model.norm=group")
    ddp = ("parallel=ddp", "parallel.nproc=2", "parallel.timeout_s=60")
    result = run_cli(*small_run(tmp_path, store, shared_data, *stop, *ddp))  # lr 0, GroupNorm: val/loss stays
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["stopped_epoch"] == 2 and run.data.metrics["best_epoch"] == 1


@pytest.mark.parametrize("switch", ["aug=none", "aug=standard", "ema_decay=0.9", "graphed"])
def test_a_trainer_stopped_by_sigterm_mid_epoch_resumes_bitwise(tmp_path, shared_data, switch):
    logged = {"whole": [], "parts": []}
    whole = trainer(shared_data, tmp_path / "whole", switch)
    final = whole.fit(lambda metrics, step: logged["whole"].append((step, metrics)))

    preemption = Preemption()
    stopped = trainer(shared_data, tmp_path / "parts", switch, "fault.term_step=4", preemption=preemption)
    with preemption.installed(), pytest.raises(Preempted, match="stopped at epoch 2 step 1/3"):
        stopped.fit(lambda metrics, step: logged["parts"].append((step, metrics)))  # a real SIGTERM after step 4
    state = torch.load(tmp_path / "parts" / checkpoint.FILE, weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 1) and len(state["running"]["loss"]) == 1
    assert (state["ema"] is not None) == switch.startswith("ema_decay")

    resumed = trainer(shared_data, tmp_path / "parts", switch, "fault.term_step=4")
    resumed.load_state_dict(state)
    resumed_final = resumed.fit(lambda metrics, step: logged["parts"].append((step, metrics)))

    def kept(entries):
        return [(step, {k: v for k, v in m.items() if not k.startswith(NOT_RESULTS)}) for step, m in entries]

    assert kept(logged["parts"]) == kept(logged["whole"]) and [s for s, _ in logged["parts"]] == [0, 1, 2, 3]
    assert {k: v for k, v in resumed_final.items() if not k.startswith(NOT_RESULTS)} == {
        k: v for k, v in final.items() if not k.startswith(NOT_RESULTS)
    }
    assert_same_weights(tmp_path / "parts" / checkpoint.FILE, tmp_path / "whole" / checkpoint.FILE)
