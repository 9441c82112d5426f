"""The docs' generated parts (``src/reference.py``): every page as ``python -m src.reference`` writes it from the
code, the zoo's models and the presets' jobs as Hydra makes them."""

from __future__ import annotations

import shutil

import pytest

from src import reference
from src.config.reference import blocks_in
from src.models import MODELS
from tests.helpers import ROOT, jobs


def test_every_generated_block_of_the_docs_is_what_the_code_writes():
    stale = [str(path.relative_to(ROOT)) for path, text in reference.generated().items() if path.read_text() != text]
    assert not stale, f"{', '.join(stale)}: generated from the code, which changed: run python -m src.reference"


def test_the_pages_hold_their_blocks():
    held = {page: blocks_in((ROOT / page).read_text()) for page in reference.PAGES}
    assert held == {
        "README.md": ["presets"],
        "docs/configuration.md": ["models", "keys", "report-keys"],
        "docs/sweeps.md": ["presets"],
    }


def test_the_model_list_is_the_registry():
    assert reference.models().startswith(f"{len(MODELS)} registered")
    assert [name.strip("`") for name in reference.models().split(": ", 1)[1].replace(" (default)", "").split()] == list(
        MODELS
    )


@pytest.mark.parametrize("preset", ["activation_init", "memory", "models", "parallel", "seeds"])
def test_a_grid_presets_jobs_are_those_hydras_sweeper_makes(preset):
    row = next(line for line in reference.presets().splitlines() if line.startswith(f"| `{preset}` |"))
    assert row.endswith(f"| {len(jobs(f'preset={preset}'))} |")


def test_the_command_writes_a_stale_page_and_its_check_lists_it(tmp_path, monkeypatch, capsys):
    for page in reference.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| `seeds` | `seed=0,1,2` |  | 3 |", "| `seeds` | 2 seeds | | 2 |"))
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    assert reference.main(["--check"]) == 1 and capsys.readouterr().out == "differs: README.md\n"
    assert reference.main([]) == 0 and capsys.readouterr().out == "written: README.md\n"
    assert readme.read_text() == (ROOT / "README.md").read_text()
    assert reference.main(["--check"]) == 0 and capsys.readouterr().out == ""
