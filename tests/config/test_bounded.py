"""src/config/bounded.py: files anyone may have written, read bounded; YAML loaded safely within its limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from src.config.bounded import MAX_BYTES, MAX_DEPTH, MAX_VALUES, Refused, Unfit, bounded_tree, load_yaml, read_bounded
from tests.helpers import alias_bomb, compose_config


def merge_bomb(levels: int = 9) -> str:
    """The same with merge keys: each mapping merges ten aliases of the one before (PyYAML copies what it merges)."""
    lines = ["m0: &m0 {" + ", ".join(f"k{j}: v" for j in range(10)) + "}"]
    lines += [f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 10)}]}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


REFUSED = {  # what a hostile or runaway file holds -> what the one line says
    "an alias bomb": (alias_bomb(), f"more than {MAX_VALUES} values once its YAML aliases are expanded"),
    "a merge-key bomb": (merge_bomb(), f"more than {MAX_VALUES} values"),
    "a wide alias bomb": (alias_bomb(levels=3, width=200), f"more than {MAX_VALUES} values"),
    "an alias inside its anchor": ("a: &a [1, *a]\n", "refers to itself (one of its YAML aliases inside what it names"),
    "a mapping inside itself": ("a: &a {b: *a}\n", "refers to itself (one of its YAML aliases inside what it names"),
    "nesting 65 levels": ("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", "nests deeper than"),
    "nesting 100000 levels": ("a: " + "[" * 100_000 + "\n", "nests deeper than"),
    "aliases nesting deep": (
        "a0: &a0 " + "[" * 40 + "]" * 40 + "\na1: &a1 " + "[" * 40 + "*a0" + "]" * 40 + "\n",
        "nests deeper than",
    ),
    "too many values": ("".join(f"k{i}: {i}\n" for i in range(MAX_VALUES)), f"more than {MAX_VALUES} values"),
    "too large": ("a: " + "x" * MAX_BYTES + "\n", f"holds more than {MAX_BYTES} bytes"),
}


@pytest.mark.parametrize("text,why", REFUSED.values(), ids=REFUSED)
def test_a_runaway_yaml_is_refused_in_one_line_naming_it(tmp_path, text, why):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(Refused) as refused:
        load_yaml(path, "the artifact")
    message = str(refused.value)
    assert message.startswith("the artifact ") and why in message and message.endswith(": not read"), message
    assert "\n" not in message


NOT_CONFIGS = {  # not a config: a YAML error, which the reader words as its own (a damaged artifact, a default store)
    "a python tag": "a: !!python/object/apply:os.system ['true']\n",
    "a pathlib tag OmegaConf would build": "a: !!python/object/apply:pathlib.Path ['x']\n",
    "a python name": "a: !!python/name:os.system\n",
    "a string": "'a: &a [1, *a]'\n",  # OmegaConf.create parses a string as YAML again: its alias inside its anchor
    "a list": "[1, 2]\n",
    "a key given twice": "a: 1\na: 2\n",
    "not UTF-8": "\x00\xff",
    "an unclosed flow": "epochs: [unclosed\n",
}


@pytest.mark.parametrize("text", NOT_CONFIGS.values(), ids=NOT_CONFIGS)
def test_a_yaml_that_is_no_config_is_a_yaml_error(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(yaml.YAMLError):
        load_yaml(path)


def test_a_config_hydra_wrote_loads_as_omegaconf_loads_it(tmp_path):
    path = tmp_path / "config.yaml"
    OmegaConf.save(compose_config("model=resnet10", "optim.lr=1e-3", "ema_decay=0.99"), path)
    assert load_yaml(path) == OmegaConf.load(path)
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == OmegaConf.create()
    (tmp_path / "utf16.yaml").write_bytes("epochs: 3\n".encode("utf-16"))  # a BOM says its encoding, as for YAML
    assert load_yaml(tmp_path / "utf16.yaml") == OmegaConf.create({"epochs": 3})
    (tmp_path / "anchors.yaml").write_text("a: &a {x: 1}\nb: *a\nc: {<<: *a, y: 2}\n")  # a few aliases: as YAML says
    assert OmegaConf.to_container(load_yaml(tmp_path / "anchors.yaml")) == {
        "a": {"x": 1},
        "b": {"x": 1},
        "c": {"x": 1, "y": 2},
    }


def test_what_is_not_a_regular_file_is_not_read_and_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "pipe")  # opened for reading, a pipe nobody writes to blocked until a writer came
    (tmp_path / "folder").mkdir()
    for name, kind in (("pipe", "a pipe"), ("folder", "a folder")):
        with pytest.raises(Unfit, match=f"^is {kind}, not a file$"):
            read_bounded(tmp_path / name, 10)
        with pytest.raises(Refused, match=f"^{tmp_path / name} is {kind}, not a file: not read$"):
            load_yaml(tmp_path / name)
    with pytest.raises(Unfit, match="^is a device or socket, not a file$"):
        read_bounded(Path("/dev/zero"), 10)  # endless
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "absent", 10)
    (tmp_path / "ten").write_bytes(b"0123456789")
    assert read_bounded(tmp_path / "ten", 10) == b"0123456789"
    with pytest.raises(Unfit, match="^holds more than 9 bytes$"):
        read_bounded(tmp_path / "ten", 9)


def test_a_python_tree_is_bounded_as_its_yaml_would_be():
    """A config unpickled from a checkpoint keeps its sharing: a list referred to many times is counted each time."""
    bomb: list = ["lol"] * 10
    for _ in range(8):
        bomb = [bomb] * 10
    loop: dict = {"a": 1}
    loop["self"] = loop
    for tree, why in ((bomb, f"holds more than {MAX_VALUES} values"), (loop, "refers to itself")):
        with pytest.raises(Refused, match=f"^the config {why}"):
            bounded_tree({"epochs": tree}, "the config")
    config = OmegaConf.to_container(compose_config("model=resnet10"), resolve=True, enum_to_str=True)
    assert bounded_tree(config, "the config") is config
