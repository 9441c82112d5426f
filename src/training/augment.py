"""Training-time augmentation of a batch on its own device: flips, 90-degree turns, affine, intensity.

Batched (no loop over samples), each sample's parameters drawn from the given generator only, no host sync,
so it can run inside a CUDA training loop. :func:`step_generator` seeds that generator from (seed, epoch, step,
rank): the augmentation of every micro-step is a pure function of those numbers, so seeded reruns and resumed
runs see the same batches with no RNG state to save.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from src.config import AugConfig

# The tensor dims (N, C, D, H, W) of the three planes turned by rot90: (D, H), (D, W), (H, W).
PLANES = ((2, 3), (2, 4), (3, 4))
# Columns of the per-sample uniform draw; fixed, so one switch never changes another's parameters.
# FLIP: 3 axes; TURN: one turn code; APPLY: affine or not; AFFINE: 3 angles, zoom, 3 shifts.
FLIP, TURN, APPLY, AFFINE, CONTRAST, BRIGHTNESS, DRAWS = 0, 3, 4, 5, 12, 13, 14
BACKGROUND = -1.0  # MedMNIST's background, uint8 0, after normalisation to [-1, 1]
_M64 = (1 << 64) - 1
_STREAM_TAG = 0x6D65_6473_7765_6570  # "medsweep": keeps these streams apart from torch.manual_seed(seed)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """A 63-bit seed mixed (splitmix64) from the tuple; any change of one element gives another seed."""
    h = _splitmix64(_STREAM_TAG)
    for value in (seed, epoch, step, rank):
        h = _splitmix64(h ^ (value & _M64))
    return h >> 1


def step_generator(device: torch.device | str, seed: int, epoch: int, step: int, rank: int) -> torch.Generator:
    """A generator on ``device`` seeded by :func:`step_seed`; create one per micro-step."""
    return torch.Generator(device=device).manual_seed(step_seed(seed, epoch, step, rank))


def _per_sample(mask: torch.Tensor) -> torch.Tensor:
    """``(N,)`` to ``(N, 1, 1, 1, 1)``, broadcasting over a volume batch."""
    return mask.view(-1, 1, 1, 1, 1)


def _along(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``(M, size)`` viewed ``(M, 1, 1, 1)`` with ``size`` at spatial ``axis`` (0, 1, 2: D, H, W)."""
    shape = [1, 1, 1]
    shape[axis] = t.shape[1]
    return t.view(t.shape[0], *shape)


def turn_moves(code: int) -> list[int]:
    """The voxel moves of turn ``code`` = 16 k0 + 4 k1 + k2 (k_p quarter turns, as ``torch.rot90``, in plane
    ``PLANES[p]``, p = 0, 1, 2 in order): the input spatial axis (0, 1, 2: D, H, W) each output axis shows, then
    whether each output axis is mirrored.

    In plane (a, b), k turns are: k=1 transpose then flip a, k=2 flip a and b, k=3 transpose then flip b; and a
    flip of a before a transpose is a flip of b after it.
    """
    axes, flips = [0, 1, 2], [False] * 3
    for k, (a, b) in zip((code // 16, code // 4 % 4, code % 4), PLANES, strict=True):
        a, b = a - 2, b - 2
        if k % 2:
            axes[a], axes[b], flips[a], flips[b] = axes[b], axes[a], flips[b], flips[a]
        flips[a] ^= k in (1, 2)
        flips[b] ^= k >= 2
    return axes + flips


@functools.cache
def _turn_table(device: torch.device) -> torch.Tensor:
    """:func:`turn_moves` of every code as an int64 ``(64, 6)`` tensor on ``device`` (copied there once)."""
    return torch.tensor([turn_moves(code) for code in range(64)], device=device)


@functools.cache
def _indices(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``0 .. size - 1`` and its mirror, on ``device``."""
    forward = torch.arange(size, device=device)
    return forward, forward.flip(0)


@functools.cache
def _centres(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The voxel centres of an axis of ``size`` on the [-1, 1] grid (``align_corners=False``)."""
    return (torch.arange(size, device=device, dtype=dtype) * 2 + 1) / size - 1


@functools.cache
def _rotation_basis(device: torch.device) -> torch.Tensor:
    """``(3, 3, 3, 3)``: for each axis, the constant, cosine and sine parts of the rotation about it."""
    basis = torch.zeros(3, 3, 3, 3)
    for axis, (i, j) in enumerate(((1, 2), (0, 2), (0, 1))):
        basis[0, axis, axis, axis] = 1
        basis[1, axis, i, i] = basis[1, axis, j, j] = 1
        basis[2, axis, i, j], basis[2, axis, j, i] = -1, 1
    return basis.to(device)


def permute_voxels(x: torch.Tensor, codes: torch.Tensor | None, flips: torch.Tensor | None) -> torch.Tensor:
    """Per sample, the turns of ``codes[i]`` (see :func:`turn_moves`; ``(N,)`` in [0, 64)), then the spatial axes
    where ``flips`` (bool ``(N, 3)``) is set mirrored: exact voxel moves, as one gather over each volume (one
    index per voxel, summed from one small per-sample table per axis). Turns need cubic volumes."""
    n, c, *sizes = x.shape
    strides = [sizes[1] * sizes[2], sizes[2], 1]
    if codes is None:
        axes, mirror = None, flips
    else:
        moves = _turn_table(x.device)[codes]
        axes, mirror = moves[:, :3], moves[:, 3:].bool() if flips is None else moves[:, 3:].bool() ^ flips
    steps = None if axes is None else sizes[0] ** (2 - axes)  # (N, 3): turned volumes are cubic
    index = None
    for axis, size in enumerate(sizes):
        forward, mirrored = _indices(size, x.device)
        coord = torch.where(mirror[:, axis, None], mirrored, forward)  # (N, size)
        term = _along(coord * (strides[axis] if steps is None else steps[:, axis, None]), axis)
        index = term if index is None else index + term
    return x.reshape(n, c, -1).gather(2, index.view(n, 1, -1).expand(n, c, -1)).view(x.shape)


def affine_matrices(signed: torch.Tensor, degrees: float, scale: float, translate: float) -> torch.Tensor:
    """``(N, 3, 4)`` matrices for ``F.affine_grid`` from uniforms in [-1, 1) (``(N, 7)``: 3 angles, scale,
    3 shifts): rotation in +-``degrees`` about each axis, isotropic zoom in 1 +- ``scale``, shift in
    +-``translate`` sides."""
    angles = signed[:, 0:3] * math.radians(degrees)
    const, cos, sin = _rotation_basis(signed.device)
    per_axis = const + angles.cos()[..., None, None] * cos + angles.sin()[..., None, None] * sin  # (N, axis, 3, 3)
    rotation = per_axis[:, 2] @ per_axis[:, 1] @ per_axis[:, 0]
    zoom = signed[:, 3, None, None] * scale + 1
    shift = signed[:, 4:7, None] * (2 * translate)  # the grid spans [-1, 1]: a side is 2
    return torch.cat([rotation / zoom, shift], -1)


def affine_grid(theta: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``F.affine_grid(theta, shape, align_corners=False)`` from one small term per axis: a grid point is linear
    in each voxel-centre coordinate, so three broadcast adds replace a (N, D*H*W, 4) x (N, 4, 3) bmm (about 5x
    faster on CPU)."""
    columns = theta[:, None, None, None]  # (N, 1, 1, 1, 3, 4)
    grid = columns[..., 3]
    for axis, size in enumerate(shape[2:]):  # grid coordinate 2 - axis (x = W, y = H, z = D) runs along ``axis``
        centres = _centres(size, theta.device, theta.dtype)
        grid = grid + _along(centres[None], axis)[..., None] * columns[..., 2 - axis]
    return grid


def resample(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``x`` sampled (trilinear, align_corners=False) on :func:`affine_grid`; outside is :data:`BACKGROUND`."""
    grid = affine_grid(theta.to(x.dtype), x.shape)
    sampled = F.grid_sample(
        x - BACKGROUND,
        grid,
        mode="bilinear",  # trilinear on 5D
        padding_mode="zeros",
        align_corners=False,
    )
    return sampled + BACKGROUND


class Augment:
    """The augmentation of ``cfg`` (see :class:`src.config.AugConfig`) as ``augment(images, generator)``.

    ``images``: a float batch ``(N, C, D, H, W)`` in [-1, 1] on any device; the result has its shape, dtype,
    device and strides (channels_last_3d stays channels_last_3d). Call it outside autocast (it turns autocast
    off inside, so it returns the input's dtype either way). Disabled (every switch off), it returns
    ``images`` itself; :attr:`enabled` lets the caller skip the call.
    """

    def __init__(self, cfg: AugConfig) -> None:
        self.cfg = cfg

    @property
    def enabled(self) -> bool:
        return self.cfg.flip or self.cfg.rot90 or self.cfg.affine or self.cfg.intensity

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if not self.enabled:
            return images
        if images.ndim != 5:
            raise ValueError(f"augment expects a batch (N, C, D, H, W), got shape {tuple(images.shape)}")
        if self.cfg.rot90 and len(set(images.shape[2:])) != 1:
            raise ValueError(
                f"aug.rot90 needs cubic volumes, got {tuple(images.shape[2:])} (D, H, W): set aug.rot90=false"
            )
        with torch.autocast(images.device.type, enabled=False):
            out = self._augment(images, generator)
        return out if out.stride() == images.stride() else torch.empty_like(images).copy_(out)

    def _augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        u = torch.rand((x.shape[0], DRAWS), generator=generator, device=x.device)
        signed = u * 2 - 1
        if cfg.flip or cfg.rot90:
            x = permute_voxels(
                x, (u[:, TURN] * 64).long() if cfg.rot90 else None, u[:, FLIP:TURN] < 0.5 if cfg.flip else None
            )
        if cfg.affine:
            theta = affine_matrices(
                signed[:, AFFINE:CONTRAST], cfg.affine_degrees, cfg.affine_scale, cfg.affine_translate
            )
            moved = resample(x, theta)
            x = moved if cfg.affine_p >= 1 else torch.where(_per_sample(u[:, APPLY] < cfg.affine_p), moved, x)
        if cfg.intensity:
            contrast = signed[:, CONTRAST] * cfg.intensity_scale + 1
            brightness = signed[:, BRIGHTNESS] * cfg.intensity_shift
            x = torch.addcmul(_per_sample(brightness).to(x.dtype), x, _per_sample(contrast).to(x.dtype))
            if cfg.noise_std > 0:
                x = x + cfg.noise_std * torch.empty_like(x).normal_(generator=generator)
        return x
