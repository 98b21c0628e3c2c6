"""CTR models with one interface: `forward(x: ModelInput) -> logits (B,)`."""
from mariana.trainer.models.base import CTRModel, ModelInput, TableSpec, build_model

__all__ = ["CTRModel", "ModelInput", "TableSpec", "build_model"]
