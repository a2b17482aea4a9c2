from verispec.models.cache import KVCache
from verispec.models.config import ModelConfig
from verispec.models.loading import load_model
from verispec.models.transformer import LayerStep, Transformer

__all__ = ["KVCache", "LayerStep", "ModelConfig", "Transformer", "load_model"]
