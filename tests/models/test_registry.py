"""src/models/registry.py: Hydra's ``model`` group and ``preset=models`` come from the registry, a model registered
outside the repository composes and trains, a switch the chosen model ignores is refused."""

from __future__ import annotations

import importlib
import sys
from enum import Enum

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from torch import nn

from src.config import ModelConfig, Stem
from src.errors import UsageError
from src.models import MODELS
from src.models.registry import DEFAULTS, OWN_SWITCHES, check_model, register_model
from tests.helpers import ROOT, compose_config, run_cli, run_process, runs, small_run

PLUGIN = '''
"""A model outside medsweep: one builder, registered with its defaults."""

from collections import OrderedDict

from torch import nn

from src.config import Stem
from src.models.layers import init_weights
from src.models.registry import register_model


@register_model(stem=Stem.small)
def tinynet3d(in_channels, num_classes, stem, layers, init, init_mode):
    """A stem and a head."""
    model = nn.Sequential(OrderedDict(stem=layers.stem(in_channels, 8, stem), head=layers.head(8, num_classes)))
    init_weights(model, init, init_mode, layers.activation)
    return model
'''


@pytest.fixture
def tinynet(tmp_path, monkeypatch):
    """``tinynet3d`` registered from the module ``tinynet`` in ``tmp_path`` (on the path of the processes a test
    starts too); the registry and the ``model`` group as they were afterwards."""
    (tmp_path / "tinynet.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    models, options = dict(MODELS), dict(ConfigStore.instance().repo["model"])
    importlib.import_module("tinynet")
    yield "tinynet3d"
    del sys.modules["tinynet"]
    MODELS.clear()
    MODELS.update(models)
    ConfigStore.instance().repo["model"] = options


def zoo_options() -> tuple[list[str], str]:
    """The ``model`` group's options, and the models ``preset=models`` sweeps."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        preset = compose("config", overrides=["preset=models"], return_hydra_config=True)
        return GlobalHydra.instance().config_loader().get_group_options("model"), preset.hydra.sweeper.params.model


def test_the_model_group_and_the_zoo_preset_are_the_registry():
    assert zoo_options() == (sorted(MODELS), ",".join(MODELS))


@pytest.mark.parametrize("name", MODELS)
def test_a_model_composes_to_its_declared_defaults(name):
    assert OmegaConf.to_object(compose_config(f"model={name}")).model == ModelConfig(name=name, **MODELS[name].defaults)


@pytest.mark.slow
def test_a_model_registered_in_another_module_composes_is_swept_and_trains(tinynet, tmp_path, store, shared_data):
    options, swept = zoo_options()
    assert tinynet in options and swept.split(",")[-1] == tinynet
    assert OmegaConf.to_object(compose_config(f"model={tinynet}")).model == ModelConfig(name=tinynet, stem=Stem.small)

    train = "import tinynet; from src.train import main; main()"
    result = run_process([sys.executable, "-c", train, *small_run(tmp_path, store, shared_data, f"model={tinynet}")])
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.params["model.name"] == tinynet


@pytest.mark.parametrize("switches,defaults", [(("colour",), {}), ((), {"checkpointing": True})])
def test_a_model_declaring_an_unknown_switch_or_a_default_it_ignores_is_not_registered(switches, defaults):
    with pytest.raises(ValueError, match="^Identity: switches must be among"):
        register_model(switches, **defaults)(nn.Identity)
    assert "Identity" not in MODELS


def off_default(switch: str):
    default = DEFAULTS[switch]
    return next(m for m in type(default) if m is not default) if isinstance(default, Enum) else not default


@pytest.mark.parametrize("switch", OWN_SWITCHES)
@pytest.mark.parametrize("name", MODELS)
def test_a_switch_off_its_default_is_refused_iff_the_model_ignores_it(name, switch):
    cfg = ModelConfig(name=name, **{switch: off_default(switch)})
    if switch in MODELS[name].switches:
        check_model(cfg)
    else:
        with pytest.raises(UsageError, match=f"^model.{switch}=.*: model={name} ignores it; drop it"):
            check_model(cfg)


def test_an_ignored_switch_stops_a_sweep_in_one_line_before_any_run(tmp_path, store, shared_data):
    sweep = small_run(tmp_path, store, shared_data, "model.checkpointing=false,true")
    result = run_cli("-m", *sweep)
    users = ", ".join(name for name, model in MODELS.items() if "checkpointing" in model.switches)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: job 1 (model.checkpointing=True): model.checkpointing=true: model=resnet10 ignores it; drop it, "
        f"or use a model that acts on it: {users}"
    ]
    assert runs(store) == []
