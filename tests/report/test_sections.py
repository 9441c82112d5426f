"""src/report/sections.py: the report's content built from a runs frame without writing a file (the files themselves:
``tests/report/test_writer.py``)."""

from __future__ import annotations

import base64
from datetime import datetime
from pathlib import Path

import pandas as pd

from src.report.analysis import CONFIG_HASH, PROVENANCE, SET_ASIDE
from src.report.runs import Selection
from src.report.sections import (
    EFFECTS_FIGURE,
    THROUGHPUT_FIGURE,
    Section,
    analyse,
    html_page,
    markdown_page,
    mixed_note,
    report_sections,
)
from src.report.writer import report
from tests.report.helpers import MARGINS, activation_runs, amp_runs, as_run_frame, report_config, store_with, tables

WRITTEN = datetime(2026, 11, 29, 10, 30)
SELECTION = Selection("constructed", [], "p1", Path("unused"))  # no folder is read or written


def test_the_sections_come_in_order_with_the_time_given_and_no_file_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = as_run_frame(activation_runs())
    sections = report_sections(
        analyse(runs, MARGINS), SELECTION, "sqlite:///x.db", MARGINS, {THROUGHPUT_FIGURE: 0, EFFECTS_FIGURE: 0}, WRITTEN
    )
    assert [s.title for s in sections] == ["", "Configurations", "Paired effects", "Datasets", "Finished runs"]
    assert sections[0].text == (
        "Finished runs: 16, not finished: 0, of constructed in sqlite:///x.db (parent run p1); swept: "
        "`model.activation`, `seed`; written 2026-11-29 10:30."
    )
    assert [s.image for s in sections] == [None, THROUGHPUT_FIGURE, EFFECTS_FIGURE, None, None]
    assert list(tmp_path.iterdir()) == []


def test_the_values_a_figure_left_out_are_told_under_it():
    analysis = analyse(as_run_frame(activation_runs()), MARGINS)
    sections = report_sections(analysis, SELECTION, "uri", MARGINS, {THROUGHPUT_FIGURE: 2, EFFECTS_FIGURE: 3}, WRITTEN)
    texts = {s.title: s.text for s in sections}
    assert texts["Configurations"].endswith(
        " Not drawn: 2 configurations (missing, infinite, negative, or a ratio not above 0)."
    )
    assert texts["Paired effects"].endswith(
        " Not drawn: 3 values of pairs (missing, infinite, negative, or a ratio not above 0)."
    )


def test_without_pairs_the_effects_are_one_line_and_no_figure():
    runs = as_run_frame(activation_runs())
    analysis = analyse(runs[runs["model.activation"] == "gelu"], MARGINS)
    assert analysis.effects.empty
    (effects,) = (
        s
        for s in report_sections(analysis, SELECTION, "uri", MARGINS, {THROUGHPUT_FIGURE: 0}, WRITTEN)
        if s.title == "Paired effects"
    )
    assert effects == Section("Paired effects", "No two finished runs differ in only one swept parameter.")


def test_runs_not_finished_get_their_own_section_and_older_runs_are_set_aside():
    once = activation_runs()
    runs = as_run_frame(pd.concat([once, once.iloc[:1]], ignore_index=True))  # run16: run0's configuration again
    runs[CONFIG_HASH] = [f"h{i}" for i in range(len(once))] + ["h0"]
    runs.loc[2, "status"] = "FAILED"
    analysis = analyse(runs, MARGINS)
    assert analysis.runs[SET_ASIDE].tolist() == [True] + [False] * len(once)
    assert len(analysis.finished) == len(once) - 1 and analysis.not_finished["run_id"].tolist() == ["run2"]
    sections = report_sections(analysis, SELECTION, "uri", MARGINS, {THROUGHPUT_FIGURE: 0, EFFECTS_FIGURE: 0}, WRITTEN)
    assert sections[1].text.startswith("Set aside: 1 older FINISHED run of configurations run again")
    assert sections[-1].title == "Not finished" and sections[-1].table["run_id"].tolist() == ["run2"]


def test_the_pages_link_or_embed_the_figures_and_escape_the_text():
    table = pd.DataFrame({"a|b": ["<x>"]})
    sections = [Section("", "opening `code`"), Section("Figure", "text & more", table, "f.png")]
    markdown = markdown_page("T <1>", sections)
    assert markdown.startswith("# T <1>\n\nopening `code`\n\n## Figure\n\ntext & more\n\n")
    assert tables(markdown) == {"Figure": [{"a\\|b": "<x>"}]}
    assert markdown.endswith("![Figure](f.png)\n")
    png = b"\x89PNG bytes"
    page = html_page("T <1>", sections, {"f.png": png})
    assert "<title>T &lt;1&gt;</title>" in page and "<p>opening code</p>" in page and "text &amp; more" in page
    assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page


def test_runs_of_other_code_or_machines_are_named_once_at_the_top(tmp_path):
    runs = amp_runs()
    for i, (_, _, tags) in enumerate(runs):  # a sweep resumed after an edit of the code, and over two hosts
        tags.update({"code_fingerprint": "old" if i == 0 else "new", "host": f"node{i % 2}"})
    _, uri, _ = store_with(tmp_path, "medsweep", runs)
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    markdown = (out / "report.md").read_text()
    assert markdown.count("Not like for like") == 1
    assert (
        "the finished runs differ in `code_fingerprint` new (3 runs), old (1 run); `host` node0 (2 runs), node1 "
        "(2 runs)." in markdown
    )
    assert markdown.index("Not like for like") < markdown.index("## Configurations")
    untagged = pd.DataFrame({tag: ["", ""] for tag in PROVENANCE})  # runs logged before these tags: not told apart
    assert mixed_note(untagged.assign(host="node0")) == ""
