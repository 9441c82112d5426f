"""src/training/metrics.py: MedMNIST's ACC and AUC and the clinical metrics against medmnist and scikit-learn,
calibration on known cases, the evaluation artifacts."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from medmnist import Evaluator
from medmnist.evaluator import getACC
from sklearn.metrics import accuracy_score, balanced_accuracy_score, recall_score, roc_auc_score

from src.training.metrics import (
    clinical_metrics,
    expected_calibration_error,
    medmnist_metrics,
    predicted,
    write_eval_artifacts,
)


def random_split(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, k, n), rng.dirichlet(np.ones(k), n).astype(np.float32)


def test_binary_metrics_equal_sklearn() -> None:
    labels, scores = random_split(200, 2)
    pred = (scores[:, 1] > 0.5).astype(int)
    metrics = clinical_metrics(labels, scores, "binary-class")
    assert set(metrics) == {"balanced_acc", "ece", "sensitivity", "specificity"}
    assert metrics["balanced_acc"] == pytest.approx(balanced_accuracy_score(labels, pred))
    assert metrics["sensitivity"] == pytest.approx(recall_score(labels, pred, pos_label=1))
    assert metrics["specificity"] == pytest.approx(recall_score(labels, pred, pos_label=0))


def test_multiclass_metrics_equal_sklearn() -> None:
    labels, scores = random_split(300, 3, seed=1)
    metrics = clinical_metrics(labels, scores, "multi-class")
    assert set(metrics) == {"balanced_acc", "ece", "auc_class0", "auc_class1", "auc_class2"}
    assert metrics["balanced_acc"] == pytest.approx(balanced_accuracy_score(labels, scores.argmax(1)))
    for k in range(3):
        assert metrics[f"auc_class{k}"] == pytest.approx(roc_auc_score(labels == k, scores[:, k]))


@pytest.mark.parametrize("task, k", [("binary-class", 2), ("multi-class", 4)])
def test_predicted_class_is_medmnists(task: str, k: int) -> None:
    labels, scores = random_split(500, k, seed=2)
    scores[:20] = 0.5 if k == 2 else 1 / k  # ties
    if k == 2:
        scores[20:40] = [0.3, 0.45]  # not summing to 1: the threshold on the last column, not the argmax, decides
        assert (predicted(scores[20:40], task) == 0).all()
    assert accuracy_score(labels, predicted(scores, task)) == getACC(labels, scores, task)


def test_ece_zero_when_calibrated() -> None:
    # p1 = 0.8 for 10 samples, 8 of them class 1; p1 = 0.4 (confidence 0.6 in class 0) for 5, 3 of them class 0
    scores = np.array([[0.2, 0.8]] * 10 + [[0.6, 0.4]] * 5)
    labels = np.array([1] * 8 + [0] * 2 + [0] * 3 + [1] * 2)
    assert expected_calibration_error(labels, scores, "binary-class") == pytest.approx(0.0, abs=1e-12)
    rng = np.random.default_rng(3)
    scores = rng.dirichlet(np.ones(3), 200_000)
    labels = (rng.random((len(scores), 1)) > scores.cumsum(1)).sum(1)  # drawn from the scores themselves
    assert clinical_metrics(labels, scores, "multi-class")["ece"] == pytest.approx(0.0, abs=0.01)


def test_ece_known_miscalibration() -> None:
    scores = np.tile([0.9, 0.05, 0.05], (10, 1))
    labels = np.array([0] * 6 + [1] * 4)
    assert expected_calibration_error(labels, scores, "multi-class") == pytest.approx(0.3)


def test_ece_equals_binned_definition() -> None:
    labels, scores = random_split(1000, 3, seed=4)
    pred = scores.argmax(1)
    confidence, correct = scores.max(1), pred == labels
    expected = 0.0
    for b in range(15):
        in_bin = (confidence > b / 15) & (confidence <= (b + 1) / 15)
        if in_bin.any():
            expected += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    assert expected_calibration_error(labels, scores, "multi-class") == pytest.approx(expected, rel=1e-5)


def test_one_class_split_gives_nan_without_warnings() -> None:
    _, scores = random_split(30, 2, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        binary = clinical_metrics(np.zeros(30, int), scores, "binary-class")
        multi = clinical_metrics(np.zeros(30, int), random_split(30, 3, seed=6)[1], "multi-class")
    assert math.isnan(binary["sensitivity"]) and not math.isnan(binary["specificity"])
    assert math.isnan(multi["auc_class0"]) and math.isnan(multi["auc_class1"]) and math.isnan(multi["auc_class2"])
    assert not math.isnan(binary["balanced_acc"]) and not math.isnan(binary["ece"])


def test_artifacts_round_trip(tmp_path) -> None:
    labels, scores = random_split(50, 3, seed=7)
    labels[labels == 2] = 0  # a class absent from the split still gets its row
    names = ["a", "b", "c"]
    paths = write_eval_artifacts(labels, scores, "multi-class", names, tmp_path / "eval")
    assert [p.name for p in paths] == ["confusion_matrix.png", "test_predictions.csv"]
    assert paths[0].read_bytes().startswith(b"\x89PNG")
    table = pd.read_csv(paths[1])
    assert list(table.columns) == ["index", "label", "score_0", "score_1", "score_2"]
    assert (table["index"] == np.arange(50)).all() and (table["label"] == labels).all()
    np.testing.assert_allclose(table[["score_0", "score_1", "score_2"]].to_numpy(), scores, rtol=0, atol=1e-7)


def test_the_confusion_matrix_of_many_classes_keeps_to_a_drawable_figure(tmp_path):
    """data.num_classes may be 100,000: at 1,000 the figure was 554 inches a side (past Agg's 2^16 pixels) with a
    million cell counts: a run trained, then drew it for minutes past 9 GB of memory (killed)."""
    import matplotlib.image

    from src.training.metrics import DPI, FIGURE_SIDE_MAX, write_eval_artifacts

    k = 200  # 113.5 inches uncapped
    scores = np.full((8, k), 1 / k, np.float32)
    write_eval_artifacts(np.arange(8), scores, "multi-class", [str(j) for j in range(k)], tmp_path)
    height, width = matplotlib.image.imread(tmp_path / "confusion_matrix.png").shape[:2]
    assert height <= FIGURE_SIDE_MAX * DPI and width <= (FIGURE_SIDE_MAX + 1) * DPI


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


def test_auc_is_nan_where_a_split_has_one_class():
    result = medmnist_metrics(np.zeros(4, int), np.full((4, 2), 0.5), "binary-class")
    assert np.isnan(result["auc"]) and result["acc"] == 1.0
