"""``python -m src.report``'s keys: which runs it reports, where, and how it judges them."""

from __future__ import annotations

from dataclasses import dataclass, field

from src.config.ranges import EXPERIMENT_NAME_MAX, MODEL_NAME_BANNED
from src.config.rules import Range, Text, check_keys, key
from src.config.tags import TAGS_ALLOWED, check_tags
from src.config.tracking import StoreConfig


@dataclass
class ReportMlflowConfig(StoreConfig):
    experiment: str | None = key(
        None,
        "a selector: report every run of this experiment",
        Text(null=True, limit=EXPERIMENT_NAME_MAX, whose="MLflow's limit for an experiment name"),
    )


@dataclass
class ReportConfig:
    """``python -m src.report``: one of ``sweep``, ``parent``, ``mlflow.experiment`` selects the runs (none: the latest
    sweep)."""

    mlflow: ReportMlflowConfig = field(default_factory=ReportMlflowConfig)
    sweep: str | None = key(None, "a sweep folder (it holds the parent run id)", Text(null=True))
    parent: str | None = key(None, "a sweep's parent run id", Text(null=True))
    out: str | None = key(
        None,
        "where the report goes; null: <sweep folder>/report, else reports/<parent run id or experiment>",
        Text(null=True),
    )
    margin: float = key(
        0.01,
        'the test-AUC loss a switch may cost and still be judged "no loss"',
        Range(0, 1, "[]", fix=" (an AUC difference)"),
    )
    speed_margin: float = key(
        0.05,
        'samples/s ratios within [1/(1 + it), 1 + it] are judged "no difference"',
        Range(0, 1, "[]", fix=" (a fraction of the baseline: 0.05 is 5%)"),
    )
    memory_margin: float = key(
        0.05,
        'peak-memory ratios within [1/(1 + it), 1 + it] are judged "no difference"',
        Range(0, 1, "[]", fix=" (a fraction of the baseline: 0.05 is 5%)"),
    )
    tags: list[str] = key([], "only the runs carrying every one of these tags", allowed=TAGS_ALLOWED)
    register: str | None = key(
        None,
        "register the best run's logged model (by val/auc) under this name",
        Text(null=True),
        allowed=f"an MLflow model name: no {' or '.join(MODEL_NAME_BANNED)}, not . nor starting with ..",
    )

    def __post_init__(self) -> None:
        check_keys(self)
        if self.register and (banned := [c for c in MODEL_NAME_BANNED if c in self.register]):
            raise ValueError(f"register={self.register}: MLflow's model names cannot hold {' or '.join(banned)}")
        if self.register == "." or (self.register or "").startswith(".."):  # MLflow: it would resolve as a path
            raise ValueError(
                f"register={self.register}: MLflow's model names cannot be . or start with .. (a path to another "
                f"name): give a name such as medsweep-best"
            )
        check_tags(self.tags)
