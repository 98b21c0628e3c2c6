"""What every CTR model shares without torch: its hashed tables (`TableSpec`), the
registry of model kinds that `build_model` reads, and the model's dense parameters as
numpy arrays (`dense_params`), the form the optimizer, checkpoints and the wire take.

A kind's module is imported when a model of that kind is first built: logistic
regression is numpy only, so a job, a server or a shard of an LR model never imports
torch (~0.7 s of a process's start on a 2-core VM); the DNN's module imports it.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mariana.sparse.errors import ConfigError


@dataclass(frozen=True)
class TableSpec:
    """A hashed table the model reads: name, row width, init, optimizer role."""

    name: str
    dim: int
    init_scale: float
    role: str  # "linear" (per-id weights) or "embedding"


# kind -> builder(cfg, num_fields, dense_dim, image_dim, image_tower) -> model. Each model
# module registers its own (`@register`); `build_model` imports the module of a kind first.
MODELS: dict[str, Callable] = {}
MODULES = {"lr": "mariana.trainer.models.lr", "dnn": "mariana.trainer.models.sparse_dnn"}


def register(kind: str, uses_torch: bool = True) -> Callable:
    """Decorator: the builder of model kind `kind` (`@register("lr")`); `uses_torch=False`
    for a numpy-only model (torch is then neither imported nor seeded for it)."""
    def add(builder: Callable) -> Callable:
        builder.uses_torch = uses_torch
        if MODELS.setdefault(kind, builder) is not builder:
            raise ValueError(f"model kind {kind!r} registered twice ({MODELS[kind].__module__}, {builder.__module__})")
        return builder
    return add


def known_kinds() -> list[str]:
    return sorted(set(MODULES) | set(MODELS))


def build_model(cfg, num_fields: int, dense_dim: int, image_dim: int = 0, image_tower: int = 32):
    """The model of `cfg.kind` (a ModelConfig's) for a schema's field layout; a torch
    model's parameters are drawn from a generator seeded with `cfg.seed`; torch's global
    random state is left as it was (a notebook's own seeds stay its own).

    `image_dim` columns of creative features follow the `dense_dim` numeric ones
    in the dense block: LR weighs them like any dense value (mode 1), the DNN
    gives them a tower of their own (mode 2).
    """
    builder = _builder(cfg.kind)
    with _seeded(cfg.seed) if getattr(builder, "uses_torch", True) else contextlib.nullcontext():
        model = builder(cfg, num_fields, dense_dim, image_dim, image_tower)
    if not isinstance(cfg.init_bias, str):  # "auto" is resolved before training; unresolved, it is 0
        bias = dict(dense_params(model))["bias"]
        bias[...] = cfg.init_bias
    return model


@contextlib.contextmanager
def _seeded(seed: int):
    """torch's global generator seeded with `seed` inside (a model's init draws from it), as it
    was outside."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _builder(kind: str) -> Callable:
    if kind not in MODELS and kind in MODULES:
        importlib.import_module(MODULES[kind])
    builder = MODELS.get(kind)
    if builder is None:
        raise ConfigError(f"model.kind: unknown model {kind!r} (known: {', '.join(known_kinds())})")
    return builder


def kind_uses_torch(kind: str) -> bool:
    """Whether models of `kind` are torch modules; imports the kind's module (the DNN's
    imports torch), so a service that may not need torch can call it off its event loop."""
    return getattr(_builder(kind), "uses_torch", True)


def uses_torch(model) -> bool:
    """Whether `model` is a torch module (its step runs autograd) or numpy only (LR)."""
    return getattr(model, "uses_torch", True)


def dense_params(model) -> list[tuple[str, np.ndarray]]:
    """(name, array) of the model's dense parameters in `parameters()` order: numpy views of
    the parameters (a write changes the model), named as checkpoints name them."""
    if uses_torch(model):
        return [(name, p.detach().numpy()) for name, p in model.named_parameters()]
    return model.named_arrays()


def dense_size(model) -> int:
    return sum(a.size for _, a in dense_params(model))


def set_dense(model, flat: np.ndarray) -> None:
    """Copy a flat vector (`dense_params` order, a parameter server's layout) into the model."""
    offset = 0
    for _, arr in dense_params(model):
        arr[...] = flat[offset:offset + arr.size].reshape(arr.shape)
        offset += arr.size
    if offset != len(flat):
        raise ValueError(f"a dense vector of {len(flat)} values for a model of {offset}")


def dense_vector(model) -> np.ndarray:
    """The model's dense parameters as one flat float32 vector (a copy), `dense_params` order."""
    arrays = [a.reshape(-1) for _, a in dense_params(model)]
    return np.concatenate(arrays).astype(np.float32) if arrays else np.zeros(0, np.float32)
