"""On a CUDA device (marker ``gpu``, skipped without one): the precision ``amp_dtype=auto`` picks there."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from src.resolve import resolve_amp_dtype
from src.training.optim import Precision
from tests.helpers import compose_config

pytestmark = pytest.mark.gpu


def test_amp_auto_is_bfloat16_without_a_scaler_where_the_gpu_computes_it_natively():
    cfg = OmegaConf.to_object(compose_config("amp=true"))
    device = torch.device("cuda")
    dtype = resolve_amp_dtype(cfg, device)
    assert dtype == (torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16)
    assert Precision.build(True, dtype, device).scaler.is_enabled() == (dtype == torch.float16)
