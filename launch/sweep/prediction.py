"""The cost model's step time for a sweep point (``parallel.costmodel``), on this machine's calibration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from launch.config import RuntimeConfig


def predict_step_ms(config: RuntimeConfig, row: Mapping[str, Any]) -> float | None:
    """Predicted p50 decode step (ms) of the point ``config`` at the batch and context the
    measurement ran (``row``); None while no cost model is installed."""
    try:
        import parallel.costmodel  # noqa: F401
    except ImportError:
        return None
    return None
