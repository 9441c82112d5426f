"""Where to look at runs in MLflow's UI: the command that serves a store, and direct links to runs."""

from __future__ import annotations

import json
import logging
import urllib.parse

log = logging.getLogger(__name__)

LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def ui_base(uri: str) -> tuple[str, str | None]:
    """The UI's address for store ``uri``, and the command that serves it (None for a server, which already does)."""
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/"), None
    return LOCAL_UI, f"mlflow ui --backend-store-uri {uri}"


def runs_url(base: str, experiment_id: str, search_filter: str = "") -> str:
    query = f"?searchFilter={urllib.parse.quote(search_filter)}" if search_filter else ""
    return f"{base}/#/experiments/{experiment_id}/runs{query}"


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    runs, experiments = (json.dumps(ids, separators=(",", ":")) for ids in (run_ids, [experiment_id]))
    return f"{base}/#/compare-runs?runs={runs}&experiments={experiments}"  # no spaces: one word in a terminal


def log_links(uri: str, experiment_id: str, run_ids: list[str], search_filter: str = "") -> None:
    """Log the command that opens the UI on ``uri`` (for a local store), the runs list (filtered by
    ``search_filter``) and the compare view of ``run_ids``; a single run's page instead of the compare view."""
    base, command = ui_base(uri)
    if command:
        log.info("MLflow UI: %s   (then open the links below)", command)
    log.info("runs: %s", runs_url(base, experiment_id, search_filter))
    if len(run_ids) == 1:
        log.info("run: %s/#/experiments/%s/runs/%s", base, experiment_id, run_ids[0])
    elif run_ids:
        log.info("compare: %s", compare_url(base, experiment_id, run_ids))
