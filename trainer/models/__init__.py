"""CTR models with one interface: `forward(x: ModelInput) -> logits (B,)`, and
`build_model(cfg, ...)`, the model of `cfg.kind`. Each model module registers its
kind (`@register("lr")`); importing this package imports them all.
"""
from mariana.trainer.models import lr, sparse_dnn  # noqa: F401  (they register "lr" and "dnn")
from mariana.trainer.models.base import MODELS, CTRModel, ModelInput, TableSpec, build_model, register

__all__ = ["MODELS", "CTRModel", "ModelInput", "TableSpec", "build_model", "register"]
