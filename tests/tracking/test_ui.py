"""src/tracking/ui.py: the links a sweep prints, followed in a real headless Chromium to a real ``mlflow server``'s runs
list and compare-runs view."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
import pytest

from tests.helpers import run_cli, serve_mlflow

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
UI_TIMEOUT_MS = 90_000  # generous: the machine running the tests may be busy


@pytest.fixture
def chromium() -> Path:
    """Debian's Chromium, with Playwright to drive it: skip when either is missing, but fail under ``CI=true``
    (CI installs both)."""
    missing = [
        name
        for name, present in (
            (str(CHROMIUM), CHROMIUM.exists()),
            ("the playwright package", importlib.util.find_spec("playwright")),
        )
        if not present
    ]
    if not missing:
        return CHROMIUM
    reason = (
        f"{' and '.join(missing)} not installed: apt-get install chromium; pip install -c constraints.txt playwright"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """A real ``mlflow server`` over an SQLite store in ``tmp_path``; always stopped."""
    with serve_mlflow(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path) as uri:
        yield uri


def as_shown(value: float) -> str:
    """A metric in [0, 10) as MLflow's UI prints it (``Utils.formatMetric``: 3 decimals, JS number text)."""
    assert 0 <= value < 10, value
    text = repr(math.floor(value * 1000 + 0.5) / 1000)  # JS Math.round: halves up
    return text.removesuffix(".0")


def row_header(page: Page, header: str) -> Locator:
    return page.locator("th.head-value", has_text=re.compile(f"^{re.escape(header)}$"))


def table_row(page: Page, header: str) -> list[str]:
    """The per-run cells of the compare view's table row named ``header`` (run details, parameters)."""
    return [
        text.strip()
        for text in page.locator("tr").filter(has=row_header(page, header)).locator(".data-value").all_inner_texts()
    ]


# The compare view's metrics are two virtualized grids (names, values per run), aligned by row offset.
READ_METRIC_GRID = """() => {
  const grids = [...document.querySelectorAll('[role=grid]')];
  if (grids.length !== 2) throw new Error(`${grids.length} grids on the compare page, expected 2`);
  const cells = grid => [...grid.querySelectorAll('[role=rowgroup] > div')];
  const rows = {};
  for (const cell of cells(grids[0])) rows[cell.style.top] = {name: cell.innerText.trim(), values: []};
  for (const cell of cells(grids[1]).sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left)))
    if (rows[cell.style.top]) rows[cell.style.top].values.push(cell.innerText.trim());  // names not yet drawn
  return Object.fromEntries(Object.values(rows).map(row => [row.name, row.values]));
}"""


TEST_ROWS_AT = 600  # pixels down the metrics grid: the test/ rows, past mem/, model/ and perf/


def scroll_metrics(page: Page, pixels: int) -> None:
    """Wheel the metrics grid down; MLflow 3.17 moves the names column one scroll event late (it reads the
    values grid's scroll state before React commits it), so a last 1-pixel event brings the names along."""
    page.get_by_role("grid").nth(1).hover()
    for delta, top in ((pixels + 1, pixels + 1), (-1, pixels)):
        page.mouse.wheel(0, delta)
        page.wait_for_function("top => document.querySelectorAll('[role=grid]')[1].scrollTop === top", arg=top)
    page.wait_for_function(
        "() => Math.abs(document.querySelectorAll('[role=grid]')[0].scrollTop - "
        "document.querySelectorAll('[role=grid]')[1].scrollTop) <= 1"
    )


def check_ui(chromium: Path, links: dict[str, str], runs: list[mlflow.entities.Run], folder: Path) -> None:
    """Follow the links a sweep printed in a fresh headless Chromium: the runs list shows ``runs`` (MLflow's
    training-runs view, not its GenAI overview), the compare view shows their params and metrics; screenshots."""
    from playwright.sync_api import expect, sync_playwright

    ids = [run.info.run_id for run in runs]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            folder / "chromium-profile",
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1600, "height": 1800},
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            expect.set_options(timeout=UI_TIMEOUT_MS)
            page.goto(links["runs"])
            expect(page.get_by_role("heading", name="Training runs")).to_be_visible()  # not the GenAI overview
            sweep_row = page.get_by_role("gridcell").filter(has_text=re.compile(r"^#\w+ sweep "))
            sweep_row.get_by_role("button").first.click()  # unfold the jobs' runs, shown under their sweep's run
            for run in runs:
                expect(page.get_by_role("link", name=run.info.run_name, exact=True)).to_be_visible()
            page.screenshot(path=folder / "runs_list.png")

            page.goto(links["compare"])
            expect(page.get_by_text(f"Comparing {len(runs)} Runs from 1 Experiment")).to_be_visible()
            expect(page.get_by_role("grid").get_by_text("best_epoch", exact=True)).to_be_visible()  # not a spinner
            assert table_row(page, "Run ID:") == ids  # one column per run, in the URL's order
            assert table_row(page, "Run Name:") == [run.info.run_name for run in runs]
            assert table_row(page, "amp") == [run.data.params["amp"] for run in runs]
            scroll_metrics(page, TEST_ROWS_AT)  # the grid is virtualized: the test/ rows lie below the perf/ ones
            expect(page.get_by_role("grid").first.get_by_text("test/auc", exact=True)).to_be_visible()
            metrics = page.evaluate(READ_METRIC_GRID)  # the rows in view
            for key in ("test/auc", "test/acc"):
                assert metrics[key] == [as_shown(run.data.metrics[key]) for run in runs], (key, metrics)

            page.get_by_role("switch", name="Parameters - Show diff only").click()
            expect(row_header(page, "model.name")).to_have_count(0)
            assert table_row(page, "amp") == [run.data.params["amp"] for run in runs]  # the parameter that differs
            expect(page.get_by_role("grid").first.get_by_text("test/auc", exact=True)).to_be_in_viewport()
            page.screenshot(path=folder / "compare_runs.png")
        finally:
            browser.close()


@pytest.mark.slow
def test_compare_runs_view_shows_the_sweeps_runs_params_and_metrics(tmp_path, chromium, mlflow_server):
    result = run_cli(
        "-m",
        f"mlflow.tracking_uri={mlflow_server}",
        "data=synthetic",
        f"data.root={tmp_path / 'data'}",
        "data.synthetic_samples=[32,16,16]",
        "model=resnet10",
        "model.stem=small",
        "batch_size=4",
        "amp=true,false",
        "epochs=1",
        "limit_batches=2",
        "num_threads=1",
        "mlflow.system_metrics=false",  # its system/ rows would push test/ below the compare view's fold
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = mlflow.MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("medsweep")
    children = [
        run
        for run in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
        if run.data.tags.get("mlflow.parentRunId")
    ]
    assert len(children) == 2 and {run.info.status for run in children} == {"FINISHED"}
    assert sorted(run.data.params["amp"] for run in children) == ["False", "True"]
    links = dict(re.findall(r"\] (runs|compare): (\S+)", result.stdout + result.stderr))
    assert links["runs"].startswith(f"{mlflow_server}/#/experiments/{experiment.experiment_id}/runs?searchFilter=")
    printed = json.loads(re.search(r"runs=(\[[^&]*\])", links["compare"]).group(1))
    children.sort(key=lambda run: printed.index(run.info.run_id))  # the compare view's columns: the link's order
    check_ui(chromium, links, children, tmp_path)
