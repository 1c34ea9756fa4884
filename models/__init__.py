"""Community-style model definitions (Llama, Qwen2, Qwen3 and the Qwen-MoE and Mixtral mixtures of
experts) on xhal's device-neutral layers, and
loading from Hugging Face checkpoint directories."""

from models.loader import load_model
from models.registry import get_model_class, register_model, supported_architectures
from models.weights import WeightsMismatchError

__all__ = [
    "WeightsMismatchError",
    "get_model_class",
    "load_model",
    "register_model",
    "supported_architectures",
]
