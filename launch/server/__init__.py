"""OpenAI-compatible HTTP server over ``launch.async_llm.AsyncLLM`` (see docs/server.md)."""

from launch.server.app import build_app

__all__ = ["build_app"]
