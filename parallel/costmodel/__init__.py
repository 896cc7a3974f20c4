"""A cost model for layouts: predicted prefill and decode step times from per-operator costs.

Pure code (no processes): ``predict_point(model_config, deployment, hardware, batch_size=,
kv_len=)`` -> ``StepPrediction``. Hardware is data (``Hardware.from_dict`` of a
``configs/hardware/*.yaml`` or of what ``simulate calibrate`` measured); ``Deployment``
is the layout and engine settings (``launch.hardware.deployment_from_config`` builds it
from a runtime config). See docs/layouts.md, "Cost model".
"""

from parallel.costmodel.deployment import Deployment, dtype_bytes
from parallel.costmodel.experts import RankLoad, compute_rank_load, synthetic_expert_load
from parallel.costmodel.hardware import Hardware
from parallel.costmodel.memory import kv_bytes_per_token_per_rank, kv_capacity_tokens, weight_bytes_per_rank
from parallel.costmodel.predict import StepPrediction, build_rank_load, predict_point
from parallel.costmodel.step import PhasePrediction, decode_work, predict_phase, prefill_work

__all__ = [
    "Deployment", "Hardware", "PhasePrediction", "RankLoad", "StepPrediction", "build_rank_load",
    "compute_rank_load", "decode_work", "dtype_bytes", "kv_bytes_per_token_per_rank", "kv_capacity_tokens",
    "predict_phase", "predict_point", "prefill_work", "synthetic_expert_load", "weight_bytes_per_rank",
]
