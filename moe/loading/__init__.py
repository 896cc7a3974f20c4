"""Safetensors checkpoint loading internals; the public entry points are in ``moe.loader``."""
