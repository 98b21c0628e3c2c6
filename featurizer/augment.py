"""Image augmentation for the image job (trainer/image.py), on normalised (B, 1, S, S)
float tensors. The random draws come from one seed alone and are made for a whole batch of
`total` rows, of which `x` is rows [start, start + len(x)) (`of=(start, total)`): each group
of a job augments only its own share, and any layout augments a global batch alike.

    shift    each image moved by a random (dy, dx) in [-shift, shift] pixels, zeros coming in
    elastic  Simard et al. (2003): a random displacement field smoothed by a Gaussian
             (sigma 4 px, scaled by alpha 34 px at 28x28; both in proportion to the side),
             composed with a random affine map (rotation +-12 degrees, scale +-10%,
             translation +-shift px), resampled bilinearly (the border pixels coming in). About ten times the CPU of
             `shift`: the input pipeline's work that prefetching hides.

>>> x = torch.ones(2, 1, 8, 8)
>>> augment(x, "shift", 0, seed=0).sum().item(), augment(x, "elastic", 1, seed=3).shape
(128.0, torch.Size([2, 1, 8, 8]))
>>> bool((augment(x, "elastic", 1, seed=3) == augment(x, "elastic", 1, seed=3)).all())
True
>>> x4 = torch.rand(4, 1, 8, 8)
>>> all(bool(torch.allclose(augment(x4, k, 2, 5)[2:], augment(x4[2:], k, 2, 5, of=(2, 4)))) for k in KINDS)
True
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KINDS = ("shift", "elastic")


def augment(x: torch.Tensor, kind: str, shift: int, seed: int, of: tuple[int, int] | None = None) -> torch.Tensor:
    start, total = of or (0, len(x))
    if kind == "shift":
        return shift_images(x, shift, seed, start, total)
    if kind == "elastic":
        return elastic_images(x, shift, seed, start, total)
    raise ValueError(f"augmentation {kind!r}: use one of {list(KINDS)}")


def shift_images(x: torch.Tensor, shift: int, seed: int, start: int = 0, total: int | None = None) -> torch.Tensor:
    if shift == 0:
        return x
    g = torch.Generator().manual_seed(seed)
    n, _, h, w = x.shape
    d = torch.randint(-shift, shift + 1, (total or n, 2), generator=g)[start:start + n]
    padded = F.pad(x, (shift, shift, shift, shift))
    out = torch.empty_like(x)
    for i, (dy, dx) in enumerate(d.tolist()):
        out[i] = padded[i, :, shift + dy:shift + dy + h, shift + dx:shift + dx + w]
    return out


def elastic_images(x: torch.Tensor, shift: int, seed: int, start: int = 0, total: int | None = None,
                   alpha: float = 34.0, sigma: float = 4.0, rotate_deg: float = 12.0,
                   scale: float = 0.1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, _, h, w = x.shape
    total = total or n
    rows = slice(start, start + n)
    alpha, sigma = alpha * w / 28, sigma * w / 28
    k = min(2 * math.ceil(3 * sigma) + 1, 2 * ((min(h, w) - 1) // 2) + 1)  # +-3 sigma, odd, under the side
    t = torch.arange(k, dtype=torch.float32) - k // 2
    kernel = torch.exp(-t * t / (2 * sigma * sigma))
    kernel /= kernel.sum()
    field = torch.rand(total * 2, 1, h, w, generator=g)[2 * start:2 * (start + n)] * 2 - 1
    field = F.conv2d(F.pad(field, (k // 2, k // 2, 0, 0), mode="reflect"), kernel.view(1, 1, 1, k))
    field = F.conv2d(F.pad(field, (0, 0, k // 2, k // 2), mode="reflect"), kernel.view(1, 1, k, 1))
    field = field.view(n, 2, h, w).permute(0, 2, 3, 1) * (2 * alpha / w)  # pixels -> grid units [-1, 1]
    angle = (torch.rand(total, generator=g)[rows] * 2 - 1) * math.radians(rotate_deg)
    size = 1 + (torch.rand(total, generator=g)[rows] * 2 - 1) * scale
    move = torch.randint(-shift, shift + 1, (total, 2), generator=g)[rows].float() * 2 / w
    theta = torch.stack([torch.stack([size * angle.cos(), -size * angle.sin(), move[:, 0]], 1),
                         torch.stack([size * angle.sin(), size * angle.cos(), move[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False) + field
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
