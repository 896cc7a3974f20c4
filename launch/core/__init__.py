"""Pure serving core: sampling params, requests, KV block allocation, scheduling, sampling.

Imports neither ``ray`` nor ``torch.distributed`` (tests/unit/test_core_imports.py keeps it
so); torch is used by the sampler only.
"""

from launch.core.batch import BatchSpec, SampledTokens, ScheduledSequence, SchedulerOutput
from launch.core.block_allocator import BlockAllocator, PrefixCacheStats
from launch.core.detokenizer import IncrementalDetokenizer, find_stop_string
from launch.core.kv_sizing import KVSizing, NoKVRoomError, compute_kv_sizing, parse_memory
from launch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from launch.core.request import Request, Sequence, SequenceStatus
from launch.core.sampler import Sampler, SamplerOutput, apply_sampling_filters
from launch.core.sampling_params import RequestOutputKind, SamplingParams
from launch.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats

__all__ = [
    "BatchSpec", "BlockAllocator", "CompletionOutput", "IncrementalDetokenizer", "KVSizing",
    "NoKVRoomError", "PrefixCacheStats", "Request", "RequestMetrics", "RequestOutput", "SampledTokens", "Sampler",
    "RequestOutputKind", "SamplerOutput", "SamplingParams", "ScheduledSequence", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SchedulerStats", "Sequence", "SequenceStatus", "apply_sampling_filters",
    "compute_kv_sizing", "find_stop_string", "parse_memory",
]
