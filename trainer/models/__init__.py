"""CTR models with one interface (see `base.CTRModel` and `lr.LogisticRegression`) and
`build_model(cfg, ...)`, the model of `cfg.kind`. Each model module registers its kind
(`@register("lr")`); `build_model` imports a kind's module when first asked for it, so
importing this package imports neither the models nor torch.
"""
from mariana.trainer.models.registry import MODELS, TableSpec, build_model, register

__all__ = ["MODELS", "CTRModel", "ModelInput", "TableSpec", "build_model", "register"]


def __getattr__(name: str):
    if name in ("CTRModel", "ModelInput"):  # torch's: imported when asked for
        from mariana.trainer.models import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
