"""Processes and the loop: engine, workers, Ray cluster, OpenAI server, CLI, benchmarks.

``from launch import LLM, SamplingParams`` is the offline API (imported lazily so the CLI
starts fast).
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from launch.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"):
        import launch.core as core

        return getattr(core, name)
    raise AttributeError(f"module 'launch' has no attribute {name!r}")
