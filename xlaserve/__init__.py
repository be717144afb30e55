"""xlaserve: a JAX/XLA, TPU-first LLM inference runtime. This package is the public facade."""

from models.config import PRESETS, ModelConfig, get_preset
from runtime.checkpoint import LoadedModel, convert, load_model
from runtime.config import EngineConfig
from runtime.llm import LLM, CompletionOutput, RequestOutput
from runtime.request import SamplingParams
from runtime.tokenizer import Tokenizer, load_tokenizer
from sharding.mesh import MeshConfig

__version__ = "0.1.0"

__all__ = ["LLM", "PRESETS", "CompletionOutput", "EngineConfig", "LoadedModel", "MeshConfig", "ModelConfig",
           "RequestOutput", "SamplingParams", "Tokenizer", "convert", "get_preset", "load_model", "load_tokenizer"]
