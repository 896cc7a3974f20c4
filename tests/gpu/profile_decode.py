"""Where a decode step's time goes on the device the engine picks (the GPU on a CUDA machine):
torch.profiler over decode steps of a batch, the top ops by self CPU time (host work, waits on
the GPU included) and by self device time, and how often the host waited on the device.

    python tests/gpu/profile_decode.py --model DIR [--batch-size 32] [--steps 10] [--top 20]

Part of ``tests/gpu/device_run.sh``; any engine flag of ``bench decode`` is taken too.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from launch.bench.decode import RecordingExecutor, build_config, build_parser, run_batch

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "aten::nonzero",
            "cudaMemcpyAsync", "cudaEventSynchronize")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    args.batch_sizes = [args.batch_size]
    config = build_config(args)
    from launch.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        recorder = RecordingExecutor(engine.executor)
        engine.executor = recorder
        mc = engine.model_config
        vocab = [t for t in range(mc.vocab_size) if t not in mc.eos_token_ids]
        # prefill and a few decode steps untimed (run_batch aborts its requests at the end); with
        # --cuda-graphs enough for the batch's graph to be recorded before the profiled steps
        from moe.cuda_graphs import CAPTURE_AFTER

        run_batch(engine, recorder, args.batch_size, args.context_len, 3, CAPTURE_AFTER, vocab=vocab, seed=0)
        params_steps = args.steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            run_batch(engine, recorder, args.batch_size, args.context_len, params_steps, 2, vocab=vocab, seed=1)
    finally:
        engine.shutdown()
    events = prof.key_averages()
    print(f"# {args.batch_size} sequences, {args.context_len}-token prompts: prefill + {params_steps + 2} decode "
          "steps profiled (totals over the run)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    if torch.cuda.is_available():
        print(events.table(sort_by="self_device_time_total", row_limit=args.top))
    for e in events:
        if e.key in SYNC_OPS:
            print(f"{e.key:>28}: {e.count} calls, {e.self_cpu_time_total / 1e3:.1f} ms self CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
