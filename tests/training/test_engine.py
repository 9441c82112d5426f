"""The train step and evaluation: MedMNIST's metrics, accumulation, precision choices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from medmnist import Evaluator
from omegaconf import OmegaConf
from torch import nn

from src.data import load_splits, make_loader, to_input
from src.errors import UsageError
from src.resolve import cpu_has_fast_bf16, resolve_amp_dtype
from src.training.metrics import medmnist_metrics
from src.training.optim import build_optimizer, class_weights
from src.training.trainer import Trainer
from tests.helpers import ROOT, compose_config, small_run


def tiny_net(num_classes: int = 2) -> nn.Module:
    """Batch-independent (GroupNorm), so a split batch gives the same gradients as the whole one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, stride=2),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, num_classes),
    )


def trainer_for(*overrides: str, data_root, model: nn.Module | None = None, width: int = 1) -> Trainer:
    """A trainer on the real AdrenalMNIST3D file on the CPU; ``width``: devices sharing one loader batch
    (``parallel=dp``), whose loaders give ``batch_size x width`` samples."""
    cfg = OmegaConf.to_object(
        compose_config("data=adrenalmnist3d", f"data.root={data_root}", "data.download=false", "device=cpu", *overrides)
    )
    cpu = torch.device("cpu")
    loaders = {
        s: make_loader(cfg.data, t, cfg.batch_size * width, cfg.seed, s == "train", cpu)
        for s, t in load_splits(cfg.data).items()
    }
    return Trainer(cfg, model or tiny_net(), loaders, cpu)


def test_binary_metrics_equal_medmnist_evaluator_on_real_labels(shared_data):
    evaluator = Evaluator("adrenalmnist3d", "test", root=str(shared_data))
    scores = torch.rand(len(evaluator.labels), 2, generator=torch.Generator().manual_seed(0)).softmax(1).numpy()
    ours = medmnist_metrics(evaluator.labels.reshape(-1), scores, "binary-class")
    theirs = evaluator.evaluate(scores)
    assert ours == {"acc": theirs.ACC, "auc": theirs.AUC}


def test_multiclass_metrics_equal_medmnist_evaluator(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 11, size=(200, 1)).astype(np.uint8)
    empty = np.zeros((0, 28, 28, 28), np.uint8)
    np.savez(
        tmp_path / "organmnist3d.npz",
        test_images=np.zeros((200, 28, 28, 28), np.uint8),
        test_labels=labels,
        train_images=empty,
        train_labels=labels[:0],
        val_images=empty,
        val_labels=labels[:0],
    )
    scores = torch.from_numpy(rng.normal(size=(200, 11))).softmax(1).numpy()
    theirs = Evaluator("organmnist3d", "test", root=str(tmp_path)).evaluate(scores)
    assert medmnist_metrics(labels.reshape(-1), scores, "multi-class") == {"acc": theirs.ACC, "auc": theirs.AUC}


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


def test_auc_is_nan_where_a_split_has_one_class():
    result = medmnist_metrics(np.zeros(4, int), np.full((4, 2), 0.5), "binary-class")
    assert np.isnan(result["auc"]) and result["acc"] == 1.0


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


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's CPU flags")
def test_native_bf16_is_the_cpus_own_flags_not_onednns_support():
    """oneDNN calls bf16 supported on any AVX-512 CPU, where it emulates it (0.33-0.44x float32 on a Xeon without
    avx512_bf16): ``amp=true`` trained slower there."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert cpu_has_fast_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_amp_dtype_resolution():
    cfg = OmegaConf.to_object(compose_config())
    assert resolve_amp_dtype(cfg, torch.device("cpu")) is (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    forced = OmegaConf.to_object(compose_config("amp_dtype=bfloat16"))
    assert resolve_amp_dtype(forced, torch.device("cpu")) is torch.bfloat16
    assert resolve_amp_dtype(cfg, torch.device("cuda")) is torch.float16
    fp16 = OmegaConf.to_object(compose_config("amp_dtype=float16"))
    with pytest.raises(UsageError, match="amp_dtype=float16 needs a CUDA device .*use amp_dtype=bfloat16 or auto"):
        resolve_amp_dtype(fp16, torch.device("cpu"))


def test_bf16_autocast_trains_on_cpu(shared_data):
    trainer = trainer_for("amp=true", "amp_dtype=bfloat16", "limit_batches=2", "batch_size=4", data_root=shared_data)
    context = trainer.precision.autocast()
    assert context.fast_dtype is torch.bfloat16 and context._enabled
    metrics = trainer.train_epoch(0)
    assert not trainer.precision.scaler.is_enabled() and np.isfinite(metrics["train/loss"])


def test_class_weights_are_sklearns_balanced_weights():
    from sklearn.utils.class_weight import compute_class_weight

    labels = torch.tensor([0] * 929 + [1] * 259)  # AdrenalMNIST3D's training split
    expected = compute_class_weight("balanced", classes=np.array([0, 1]), y=labels.numpy())
    torch.testing.assert_close(class_weights(labels, 2), torch.from_numpy(expected).float())
    assert class_weights(torch.tensor([0, 0, 2]), 3).tolist() == [0.5, 0.0, 1.0]  # an absent class weighs 0


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


def test_warmup_scales_the_learning_rate_then_hands_over_to_the_schedule(shared_data):
    trainer = trainer_for("warmup_epochs=2", "epochs=8", "optim.lr=0.01", "limit_batches=1", data_root=shared_data)
    lrs = []
    for _ in range(8):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.scheduler.step()
    assert lrs == pytest.approx([0.001, 0.0055, 0.01, 0.01, 0.001, 0.001, 0.0001, 0.0001])  # multistep at 4, 6


def test_early_stopping_stops_after_patience_epochs_without_a_better_val_auc(shared_data):
    trainer = trainer_for(
        "early_stop_patience=2", "epochs=10", "limit_batches=1", "batch_size=4", "optim.lr=0", data_root=shared_data
    )  # lr 0: val/auc never improves after epoch 1
    logged = []
    final = trainer.fit(lambda metrics, step: logged.append((step, metrics)))
    assert [step for step, _ in logged] == [0, 1, 2, 10]
    assert final["stopped_epoch"] == 3 and final["best_epoch"] == 1


def test_ema_follows_the_recurrence_over_optimizer_steps_and_is_what_evaluation_sees(shared_data):
    """EMA weights: the first step's, then ``decay x ema + (1 - decay) x weights`` after each optimizer step."""
    trainer = trainer_for("ema_decay=0.5", "batch_size=4", "accumulate=2", "limit_batches=6", data_root=shared_data)
    expected = {}

    def average(step: int) -> None:
        for name, value in trainer.raw_model.state_dict().items():
            expected[name] = value.clone() if step == 1 else 0.5 * expected[name] + 0.5 * value

    trainer.hooks.after_step = (average,)
    trainer.train_epoch(0)
    averaged, trained = trainer.evaluated.state_dict(), trainer.raw_model.state_dict()
    assert averaged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(averaged[name], value, rtol=1e-6, atol=1e-7)
        assert not torch.equal(averaged[name], trained[name]), name
    reference = tiny_net()
    reference.load_state_dict(expected)
    images = load_splits(trainer.cfg.data)["val"][0]
    with torch.no_grad():
        scores = reference.eval()(to_input(images)).softmax(1).numpy()
    np.testing.assert_allclose(trainer.predict("val")[2], scores[:24], rtol=0, atol=1e-6)  # limit_batches: 6 x 4


def test_evaluation_logs_the_clinical_metrics_and_keeps_test_predictions(shared_data):
    trainer = trainer_for("batch_size=50", data_root=shared_data)
    metrics = trainer.evaluate("test")
    assert {"test/balanced_acc", "test/ece", "test/sensitivity", "test/specificity"} <= set(metrics)
    labels, scores = trainer.test_predictions
    assert labels.shape == (298,) and scores.shape == (298, 2)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_fused_optimizer_takes_the_per_parameter_loops_steps(name):
    """``optim.fused=true`` is torch's fused kernel: the loop's update, to float rounding."""
    trained = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6**3, 3))
        cfg = OmegaConf.to_object(compose_config(f"optim={name}", f"optim.fused={str(fused).lower()}")).optim
        optimizer = build_optimizer(cfg, model.parameters())
        assert optimizer.defaults["fused"] is fused
        for step in range(3):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
        trained.append(list(model.parameters()))
    for loop, fused in zip(*trained, strict=True):
        torch.testing.assert_close(fused, loop, rtol=1e-6, atol=1e-7)


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
