"""src/config/data.py: the data keys' checks: data=nifti's ranges, MedMNIST's sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.data.nifti.folders import nifti
from tests.helpers import compose_config


def test_nifti_keys_are_range_checked_and_medmnist_sizes_stay_28_and_64():
    for overrides, line in [
        (("data=nifti", "data.size=15"), "data.size=15 must be in [16, 256] for data=nifti"),
        (("data=nifti", "data.size=257"), "data.size=257 must be in [16, 256] for data=nifti"),
        (("data=adrenalmnist3d", "data.size=100"), "data.size=100 is not a MedMNIST 3D size: use data.size=28 or 64"),
        (("data=nifti", "data.spacing=[1,0,1]"), "data.spacing[1]=0.0 must be in (0, 100.0]"),
        (("data=nifti", "data.spacing=[1e300,1e300,1e300]"), "data.spacing[0]=1e+300 must be in (0, 100.0]"),
        (("data=nifti", "data.split_fractions=[0.8,0.1,0.2]"), "data.split_fractions=[0.8, 0.1, 0.2] must sum to 1"),
        (("data=nifti", "data.split_fractions=[1,0,0]"), "data.split_fractions[0]=1.0 must be in (0, 1)"),
        (("data=nifti", "data.window_width=0"), "data.window_width=0.0 must be > 0 (the window's width)"),
        (("data=nifti", "data.classes=[a,a]"), "data.classes=['a', 'a'] must name 2 or more classes, each once"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(line)}"):
            OmegaConf.to_object(compose_config(*overrides))
    for size in (16, 37, 256):
        assert nifti(Path("/x"), f"data.size={size}").size == size
