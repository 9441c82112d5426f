"""Evaluation metrics: the MedMNIST protocol's ACC and AUC (medmnist's own functions); the metrics a clinician
reads (balanced accuracy, calibration, sensitivity/specificity, per-class AUC) from scikit-learn on MedMNIST's
predicted class; the test split's confusion matrix and per-sample predictions. medmnist and scikit-learn load at the
end of the main rank's start-up (:func:`load_libraries`), not with the modules of a job's config checks."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from src.atomic import uninterrupted
from src.spreadsheet import write_csv

BINARY = "binary-class"
ECE_BINS = 15
DPI = 120
FIGURE_SIDE_MAX = 40.0  # inches of the confusion matrix's figure: 4,800 pixels at DPI
ANNOTATED_MAX = 30  # classes up to which each cell of the confusion matrix shows its count


def load_libraries() -> None:
    """Import what evaluation uses (~70 MiB resident) before the memory baseline is taken (``Trainer.fit``): loaded at
    the first validation, it counted in the ``mem/peak_mb`` of a process's first job, not in later ones'. A second
    Ctrl-C waits for the imports' end: medmnist's catches every exception, the ``KeyboardInterrupt`` too."""
    with uninterrupted("importing evaluation's libraries"):
        import medmnist.evaluator  # noqa: F401
        import sklearn.calibration  # noqa: F401
        import sklearn.metrics  # noqa: F401


def medmnist_metrics(labels: np.ndarray, scores: np.ndarray, task: str) -> dict[str, float]:
    """ACC and AUC exactly as ``medmnist.Evaluator`` computes them (its own functions).

    AUC is NaN where it is undefined: a (truncated) split missing a class.
    """
    from medmnist.evaluator import getACC, getAUC

    try:
        auc = getAUC(labels, scores, task)
    except ValueError:  # roc_auc_score: only one class present
        auc = math.nan
    return {"acc": float(getACC(labels, scores, task)), "auc": float(auc)}


def predicted(scores: np.ndarray, task: str) -> np.ndarray:
    """The predicted class as ``medmnist.evaluator.getACC`` takes it: ``scores[:, -1] > 0.5`` if binary, else argmax."""
    return (scores[:, -1] > 0.5).astype(int) if task == BINARY else scores.argmax(axis=1)


def expected_calibration_error(labels: np.ndarray, scores: np.ndarray, task: str, n_bins: int = ECE_BINS) -> float:
    """Top-label ECE (Guo et al. 2017): sum over equal-width confidence bins of n_b/N |acc_b - conf_b|."""
    from sklearn.calibration import calibration_curve

    pred = predicted(scores, task)
    confidence = scores[np.arange(len(pred)), pred]
    acc, conf = calibration_curve((pred == labels).astype(int), confidence, pos_label=1, n_bins=n_bins)
    # calibration_curve returns the non-empty bins only, without their sizes: count with its own binning
    counts = np.bincount(np.searchsorted(np.linspace(0.0, 1.0, n_bins + 1)[1:-1], confidence), minlength=n_bins)
    return float(np.sum(counts[counts > 0] / len(labels) * np.abs(acc - conf)))


def one_vs_rest_auc(labels: np.ndarray, scores: np.ndarray, k: int) -> float:
    """ROC AUC of class ``k`` against the rest; NaN where the class is absent or the only one present."""
    from sklearn.metrics import roc_auc_score

    positive = labels == k
    return float(roc_auc_score(positive, scores[:, k])) if 0 < positive.sum() < len(labels) else math.nan


def clinical_metrics(labels: np.ndarray, scores: np.ndarray, task: str) -> dict[str, float]:
    """``balanced_acc`` and ``ece``, plus ``sensitivity``/``specificity`` (binary) or ``auc_class<k>`` (multi-class).

    A metric undefined on the split (a class missing) is NaN; balanced accuracy averages the classes present.
    """
    from sklearn.metrics import balanced_accuracy_score, recall_score

    pred = predicted(scores, task)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        metrics = {
            "balanced_acc": float(balanced_accuracy_score(labels, pred)),
            "ece": expected_calibration_error(labels, scores, task),
        }
    if task == BINARY:
        for name, positive in (("sensitivity", 1), ("specificity", 0)):
            metrics[name] = float(recall_score(labels, pred, pos_label=positive, zero_division=np.nan))
    else:
        metrics |= {f"auc_class{k}": one_vs_rest_auc(labels, scores, k) for k in range(scores.shape[1])}
    return metrics


def write_eval_artifacts(
    labels: np.ndarray, scores: np.ndarray, task: str, class_names: list[str], folder: Path
) -> list[Path]:
    """Write ``confusion_matrix.png`` and ``test_predictions.csv`` (index, label, score_k) to ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay

    folder.mkdir(parents=True, exist_ok=True)
    figure_path, csv_path = folder / "confusion_matrix.png", folder / "test_predictions.csv"
    k = scores.shape[1]
    side = min(3.5 + 0.55 * k, FIGURE_SIDE_MAX)  # 1,000 classes: 554 inches, past Agg's 2^16 pixels, ~10 GB first
    fig, ax = plt.subplots(figsize=(side + 1, side))
    ConfusionMatrixDisplay.from_predictions(
        labels,
        predicted(scores, task),
        labels=range(k),
        display_labels=class_names,
        cmap="Blues",
        include_values=k <= ANNOTATED_MAX,  # a count per cell: k^2 texts, unreadable past a few dozen classes
        values_format="d",
        ax=ax,
    )
    plt.setp(ax.get_xticklabels(), rotation=35, ha="right", rotation_mode="anchor")
    ax.set_title(f"Confusion matrix, test split (n={len(labels)})")
    fig.tight_layout()
    fig.savefig(figure_path, dpi=DPI)
    plt.close(fig)
    table = pd.DataFrame(
        {"index": np.arange(len(labels)), "label": labels, **{f"score_{j}": scores[:, j] for j in range(k)}}
    )
    write_csv(table, csv_path, float_format="%.9g")  # 9 digits: float32 scores round-trip exactly
    return [figure_path, csv_path]
