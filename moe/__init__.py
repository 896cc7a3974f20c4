"""Model code for one rank's shard of a Mixtral/DeepSeek/Qwen3-style MoE model."""

from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.model import MoEModel
from moe.moe_layer import MoELayer
from moe.router import Router

__all__ = ["AttentionMetadata", "MoELayer", "MoEModel", "ModelConfig", "PagedKVCache", "Router"]
