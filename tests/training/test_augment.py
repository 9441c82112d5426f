"""src/training/augment.py: seeded per-sample augmentation, exact voxel moves, background padding, layouts, steps."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
import torch.nn.functional as F

from src.config import AugConfig
from src.training.augment import (
    BACKGROUND,
    PLANES,
    Augment,
    affine_grid,
    affine_matrices,
    permute_voxels,
    resample,
    step_generator,
    step_seed,
)
from tests.helpers import run_process

SWITCHES = ("flip", "rot90", "affine", "intensity")


def standard(**overrides) -> AugConfig:
    """conf/aug/standard.yaml (affine on every sample) with ``overrides``, noise on."""
    values = dict(name="standard", flip=True, rot90=True, affine=True, affine_p=1.0, intensity=True, noise_std=0.02)
    return AugConfig(**{**values, **overrides})


def only(switch: str, **overrides) -> AugConfig:
    return AugConfig(name=switch, **{switch: True}, **overrides)


def volumes(n: int = 8, c: int = 1, size: int = 12, seed: int = 0) -> torch.Tensor:
    """Random uint8-like volumes normalised to [-1, 1] (distinct values, so any move shows)."""
    return torch.rand((n, c, size, size, size), generator=torch.Generator().manual_seed(seed)) * 2 - 1


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_same_generator_seed_is_bitwise_equal_another_differs():
    aug, x = Augment(standard()), volumes()
    assert torch.equal(aug(x, gen(1)), aug(x, gen(1)))
    assert not torch.allclose(aug(x, gen(1)), aug(x, gen(2)))


def test_draws_come_from_the_generator_only():
    state = torch.get_rng_state()
    Augment(standard())(volumes(), gen())
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_alone_changes_the_batch_and_each_sample_differently(switch):
    aug = Augment(only(switch))
    assert aug.enabled
    x = volumes()
    assert not torch.equal(aug(x, gen()), x)
    same = volumes(1).expand(8, -1, -1, -1, -1).contiguous()  # one volume, eight times
    out = aug(same, gen())
    assert len({tuple(v.flatten().tolist()) for v in out}) > 1


def test_all_switches_off_returns_the_input_itself():
    x = volumes()
    for cfg in (AugConfig(), AugConfig(name="off", affine_p=0.5, noise_std=0.1)):
        aug = Augment(cfg)
        assert not aug.enabled
        assert aug(x, gen()) is x


@pytest.mark.parametrize("switches", [("flip",), ("rot90",), ("flip", "rot90")])
def test_flips_and_turns_only_move_voxels(switches):
    x = volumes()
    out = Augment(AugConfig(name="moves", **{s: True for s in switches}))(x, gen())
    assert torch.equal(out.flatten(1).sort(1).values, x.flatten(1).sort(1).values)


def test_permute_voxels_matches_rot90_then_flip_for_every_combination():
    combos = [(t, f) for t in itertools.product(range(4), repeat=3) for f in itertools.product((False, True), repeat=3)]
    x = volumes(1, size=5).expand(len(combos), -1, -1, -1, -1)
    codes = torch.tensor([16 * t[0] + 4 * t[1] + t[2] for t, _ in combos])
    flips = torch.tensor([f for _, f in combos])
    out = permute_voxels(x, codes, flips)
    for i, (t, f) in enumerate(combos):
        want = x[i]
        for k, (a, b) in zip(t, PLANES, strict=True):
            want = torch.rot90(want, k, (a - 1, b - 1))
        want = want.flip([axis + 1 for axis in range(3) if f[axis]]) if any(f) else want
        assert torch.equal(out[i], want), (t, f)


def test_flips_alone_work_on_non_cubic_volumes():
    x = torch.rand((8, 2, 4, 5, 6), generator=gen())
    flips = torch.tensor(list(itertools.product((False, True), repeat=3)))
    out = permute_voxels(x, None, flips)
    for i, f in enumerate(flips.tolist()):
        assert torch.equal(out[i], x[i].flip([a + 1 for a in range(3) if f[a]]) if any(f) else x[i])


@pytest.mark.parametrize("plane", range(3))
def test_four_quarter_turns_in_a_plane_are_the_identity(plane):
    x = volumes(4, size=6)
    codes = torch.full((4,), (16, 4, 1)[plane])  # one quarter turn in ``plane``
    y = x
    for count in range(1, 5):
        y = permute_voxels(y, codes, None)
        assert torch.equal(y, x) == (count == 4)


def test_affine_with_zero_ranges_is_the_identity_and_unpicked_samples_are_exact():
    x = volumes()
    zero = Augment(only("affine", affine_degrees=0.0, affine_scale=0.0, affine_translate=0.0))
    torch.testing.assert_close(zero(x, gen()), x, atol=1e-5, rtol=0)
    assert torch.equal(Augment(only("affine", affine_p=0.0))(x, gen()), x)


@pytest.mark.parametrize("axis", range(3))
def test_affine_quarter_turn_about_an_axis_is_a_rot90(axis):
    x = volumes(1, size=6)
    signed = torch.zeros((1, 7))
    signed[0, axis] = 1.0  # the largest angle: 90 degrees about grid axis ``axis`` (x = W, y = H, z = D)
    out = resample(x, affine_matrices(signed, 90.0, 0.0, 0.0))
    torch.testing.assert_close(out, torch.rot90(x, 1, PLANES[axis]), atol=1e-5, rtol=0)


def test_affine_grid_equals_torchs():
    theta = torch.randn((3, 3, 4), generator=gen())
    shape = torch.Size((3, 2, 5, 6, 7))
    torch.testing.assert_close(
        affine_grid(theta, shape), F.affine_grid(theta, list(shape), align_corners=False), atol=1e-6, rtol=0
    )


def test_affine_matrices_stay_in_their_ranges():
    signed = torch.rand((256, 7), generator=gen()) * 2 - 1
    theta = affine_matrices(signed, 15.0, 0.1, 0.2)
    linear = theta[:, :, :3]
    zoom = linear.det().abs().pow(-1 / 3)
    assert ((zoom - 1).abs() <= 0.1 + 1e-5).all()
    torch.testing.assert_close(linear @ linear.mT * zoom.view(-1, 1, 1) ** 2, torch.eye(3).expand(256, 3, 3))
    assert (theta[:, :, 3].abs() <= 0.4 + 1e-6).all()  # 0.2 of a side; a side spans 2 grid units


def test_affine_pads_with_the_background_not_zero():
    x = torch.ones((2, 1, 8, 8, 8))
    theta = torch.eye(3, 4).repeat(2, 1, 1)
    theta[:, 0, 3] = 1.0  # sample half a side further along W: the last half of W comes from outside
    out = resample(x, theta)
    assert torch.equal(out[..., 4:], torch.full_like(out[..., 4:], BACKGROUND))
    torch.testing.assert_close(out[..., :4], x[..., :4], atol=1e-5, rtol=0)
    shifted = Augment(only("affine", affine_degrees=0.0, affine_scale=0.0, affine_translate=1.0))(x, gen())
    assert shifted.min() == BACKGROUND and (shifted >= BACKGROUND).all()
    assert all((v == BACKGROUND).any() for v in shifted)


def test_intensity_is_a_per_sample_contrast_and_brightness_in_range():
    x = volumes()
    out = Augment(only("intensity", intensity_scale=0.2, intensity_shift=0.3))(x, gen())
    centred_x, centred_out = x - x.mean((1, 2, 3, 4), keepdim=True), out - out.mean((1, 2, 3, 4), keepdim=True)
    contrast = (centred_out * centred_x).sum((1, 2, 3, 4)) / (centred_x**2).sum((1, 2, 3, 4))
    torch.testing.assert_close(centred_out, contrast.view(-1, 1, 1, 1, 1) * centred_x, atol=1e-5, rtol=0)
    assert ((contrast - 1).abs() <= 0.2 + 1e-5).all()
    brightness = out.flatten(1)[:, 0] - contrast * x.flatten(1)[:, 0]
    assert (brightness.abs() <= 0.3 + 1e-5).all()


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last_3d])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_dtype_and_memory_format_are_kept(fmt, dtype):
    x = volumes(4, c=3).to(dtype).contiguous(memory_format=fmt)
    out = Augment(standard())(x, gen())
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert out.stride() == x.stride() and out.is_contiguous(memory_format=fmt)


def test_autocast_around_the_call_still_gives_float32():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Augment(standard())(volumes(), gen())
    assert out.dtype == torch.float32


def test_non_cubic_volumes_are_refused_by_rot90_only():
    x = torch.zeros((2, 1, 8, 8, 6))
    with pytest.raises(ValueError, match="rot90 needs cubic volumes.*\\(8, 8, 6\\)"):
        Augment(only("rot90"))(x, gen())
    assert Augment(standard(rot90=False))(x, gen()).shape == x.shape


def test_step_generator_streams_are_a_pure_function_of_the_tuple():
    base = (3, 1, 7, 0)

    def draw(*key: int) -> torch.Tensor:
        return torch.rand(8, generator=step_generator("cpu", *key))

    assert torch.equal(draw(*base), draw(*base))
    for index in range(4):
        for delta in (1, -1):
            key = list(base)
            key[index] += delta
            assert not torch.equal(draw(*key), draw(*base)), key
    assert not torch.equal(draw(0, 1, 0, 0), draw(0, 0, 1, 0))  # no symmetry between the elements
    assert all(0 <= step_seed(*key) < 2**63 for key in itertools.product((-1, 0, 2**70), repeat=4))


def test_benchmark_wants_one_batch_size_per_size():
    result = run_process([sys.executable, "-m", "benchmarks.augment_share", "--sizes", "28", "64", "--batches", "8"])
    assert result.returncode == 2 and "one value per size" in result.stderr
