"""quickdraft: lossless speculative decoding for Llama-family models on PyTorch."""

from .config import EngineConfig, ModelConfig, SpecConfig
from .errors import QuickdraftError, UnsupportedModelError
from .engine import Engine, RequestOutput
from .llm import LLM
from .metrics import SpecStats
from .model.loader import load_model
from .sampling import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "load_model", "Engine", "EngineConfig", "SpecConfig",
    "ModelConfig", "SpecStats", "QuickdraftError", "UnsupportedModelError",
]
__version__ = "0.1.0"
