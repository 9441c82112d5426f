"""What a rank reports: the main rank logs to the job's MLflow run and writes the job's files
(:class:`MainReporter`); every other rank reports nothing (:class:`Reporter`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch

from src.data.files import class_names, npz_path
from src.data.loaders import to_input
from src.execution import Execution
from src.folders import EVAL_DIR, METRICS_FILE
from src.jobs import resume
from src.jobs.plan import Job
from src.parallel.mps import run_tags
from src.perf.flop_cache import counted_flops
from src.perf.memory_cache import predicted_memory_metrics
from src.perf.startup import StartupClock
from src.tracking.datasets import dataset_inputs
from src.tracking.logged_model import log_model
from src.tracking.runs import RunLogger
from src.tracking.store import ensure_store
from src.training import checkpoint
from src.training.meters import MIN_TIMED_STEPS
from src.training.metrics import write_eval_artifacts
from src.training.mfu import Mfu
from src.training.trainer import Trainer

log = logging.getLogger(__name__)
Splits = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Reporter:
    """A rank that reports nothing: every rank but the main one."""

    epoch_metrics: tuple[Callable[[dict[str, float]], dict[str, float]], ...] = ()

    def started(self, trainer: Trainer, splits: Splits) -> None:
        """The trainer is built (and its state not yet loaded)."""

    def resumed(self, trainer: Trainer) -> None:
        """The trainer loaded the checkpoint it resumes from."""

    def startup(self, clock: StartupClock, step: int) -> None:
        """The job is ready to train."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """An epoch's metrics."""

    def log_tested(self, metrics: dict[str, float], step: int) -> None:
        """The test metrics and the run's final figures."""

    def finished(self, trainer: Trainer, final: dict[str, float]) -> None:
        """Training and the test are done."""


class MainReporter(Reporter):
    """The main rank's reporting: the run's tags, dataset inputs, start-up, epoch and test metrics (the tested
    weights as an MLflow model with ``mlflow.log_model``); then the evaluation artifacts, ``best.pt`` and
    ``metrics.json`` in the job's folder."""

    def __init__(self, job: Job, execution: Execution, world: int) -> None:
        self.job, self.execution = job, execution
        self.mfu = Mfu.of(job.cfg, execution, world, counted_flops(job.cfg))
        self.epoch_metrics = (predicted_memory_metrics(job.cfg, execution), self.mfu)
        self.resumed_at_end = False  # trained to the end before it stopped: the test may be logged already

    def started(self, trainer: Trainer, splits: Splits) -> None:
        cfg, execution = self.job.cfg, self.execution
        if cfg.amp and execution.autocast is None:
            log.warning(execution.dtype_because)
        if execution.device.type == "cuda" and not execution.graphed:
            log.info("cuda_graphs: eager steps, %s", execution.eager_because)
        self.run = RunLogger(ensure_store(self.job.tracking_uri), self.job.run_id)
        tags = {**execution.tags(), "mem.source": trainer.memory.source, **run_tags(), **self.mfu.tags()}
        self.run.set_tags(tags)
        self.mfu.on_new_peak = lambda peak: self.run.set_tags(self.mfu.tags())
        self.trainer, self.splits = trainer, splits
        self.inputs = dataset_inputs(cfg.data, npz_path(cfg.data), splits)
        if not self.job.resume_from:
            self.run.log_inputs(self.inputs)

    def resumed(self, trainer: Trainer) -> None:
        for epoch, metrics in trainer.maybe_unlogged:  # checkpointed before they were logged, maybe not logged
            resume.log_missing(self.run, metrics, epoch)
        self.resumed_at_end = trainer.epoch == self.job.cfg.epochs

    def startup(self, clock: StartupClock, step: int) -> None:
        self.run.log_metrics(clock.metrics(), step=step)
        log.info("start-up %.1f s (%s)", clock.metrics()["time/startup_s"], clock.summary())

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.resumed_at_end:
            resume.log_missing(self.run, metrics, step)
        else:
            self.run.log_metrics(metrics, step)

    def log_tested(self, metrics: dict[str, float], step: int) -> None:
        """Log the test metrics, linked to the test split's dataset and, with ``mlflow.log_model``, to the tested
        weights logged first as the run's MLflow model."""
        if self.resumed_at_end:
            resume.log_missing(self.run, metrics, step)
            return
        model_id = None
        if self.job.cfg.mlflow.log_model:
            model_id = log_model(self.run, self.trainer.evaluated, to_input(self.splits["test"][0][:2]), step)
            log.info("logged the tested weights as MLflow model %s (models:/%s)", model_id, model_id)
        test = {key: value for key, value in metrics.items() if key.startswith("test/")}
        self.run.log_metrics(test, step, model_id, self.inputs[-1].dataset)
        self.run.log_metrics({key: value for key, value in metrics.items() if key not in test}, step, model_id)

    def finished(self, trainer: Trainer, final: dict[str, float]) -> None:
        cfg, folder = self.job.cfg, self.job.output_dir
        names = class_names(cfg.data)
        write_eval_artifacts(*trainer.test_predictions, cfg.data.task, names, folder / EVAL_DIR)
        checkpoint.save_weights(trainer.best_state, folder / checkpoint.BEST_FILE)
        (folder / METRICS_FILE).write_text(json.dumps(final, indent=2))
        self.tag_speed_basis(trainer, final)

    def tag_speed_basis(self, trainer: Trainer, final: dict[str, float]) -> None:
        """Tag ``perf.contended`` and say when the run timed too few steps, or was contended, for its speed to
        compare."""
        self.run.set_tags({"perf.contended": str(trainer.contended).lower()})
        steps = final.get("perf/steps_timed", 0)
        if steps < MIN_TIMED_STEPS:
            log.warning(
                "only %d steps timed (fewer than %d): this run's speed is no basis for comparison",
                steps,
                MIN_TIMED_STEPS,
            )
        if trainer.contended:
            log.warning(
                "other processes shared the machine while this run trained (perf/others_cpu): its speed is "
                "no basis for comparison; the run is tagged perf.contended=true"
            )
