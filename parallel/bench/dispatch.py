"""EP benchmarks behind ``commbench --dispatch`` and ``commbench --moe-layer``.

``--dispatch``: per rank T tokens, hidden D, top-k K over E experts (uniform random
routing, E / R slots per rank). Times our dispatch + combine without the expert GEMMs
(plan, count exchange, packing, AllToAll-v out, identity experts copying the received
rows into the return buffer, AllToAll-v back, fp32 gather + sum per token) next to two
raw ``all_to_all_single`` calls moving exactly the same bytes with split sizes known in
advance, and a "floor": raw plus one plain memcpy of the payload for each pass a
dispatcher cannot skip (gather, expert output, combine). Prints all three and the median
per-iteration ratios ours / raw and floor / raw. The identity output is checked first.

``--moe-layer``: the whole MoE layer (router, replica choice, dispatch, grouped expert
GEMMs, combine) in bf16 on a DeepSeek-V3-style config, at each rank count of --ranks;
prints tokens/s over all ranks. One rank uses the local dispatcher.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moe.config import ModelConfig
from moe.moe_layer import MoELayer
from moe.tiny import build_tiny_config
from parallel.bench.ranks import current_device, synchronize, time_op
from parallel.dispatch import AllToAllDispatcher, build_dispatcher
from parallel.dispatch.plan import DispatchPlan, row_layout, unpack_rows
from parallel.groups import build_process_groups
from parallel.layout import Layout


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform routing: ids [T, K] int64 distinct per token, weights [T, K] float32 rows summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    w, ids = torch.topk(scores, top_k, dim=1)
    return ids, w / w.sum(dim=1, keepdim=True)


def time_dispatch(rank: int, world: int, cfg: dict) -> dict:

    torch.manual_seed(rank)
    layout = Layout(dp=world)
    groups = build_process_groups(layout, rank, timeout=300)
    dispatcher = AllToAllDispatcher(groups.ep, rank, world)
    dev = current_device()
    hidden, top_k = cfg["hidden"], cfg["topk"]
    num_local = layout.num_local_slots(cfg["experts"])
    x = torch.randn(cfg["tokens"], hidden, device=dev).to(torch.bfloat16)
    ids, w = (t.to(dev) for t in random_routing(cfg["tokens"], cfg["experts"], top_k, seed=rank))

    def ours() -> torch.Tensor:
        plan, recv, recv_counts = dispatcher.dispatch(x, ids, w, num_local)
        rx, _, _ = unpack_rows(recv, hidden, top_k, x.dtype)
        # identity "experts": one copy of the received rows into the return buffer stands
        # for the real experts writing their per-row sums (Experts.forward_rows)
        wire = dispatcher.workspace.get("partial", tuple(rx.shape), x.dtype, dev)
        return dispatcher.combine(wire.copy_(rx), plan, recv_counts)

    plan, _, recv_counts = dispatcher.dispatch(x, ids, w, num_local)
    send_counts = plan.send_counts
    _, row_bytes = row_layout(hidden, top_k, x.dtype)
    fwd_send = torch.randint(0, 255, (sum(send_counts), row_bytes), dtype=torch.uint8, device=dev)
    fwd_recv = torch.empty((sum(recv_counts), row_bytes), dtype=torch.uint8, device=dev)
    back_send = torch.randn(sum(recv_counts), hidden, device=dev).to(torch.bfloat16)
    back_recv = torch.empty((sum(send_counts), hidden), dtype=torch.bfloat16, device=dev)

    def raw() -> None:
        torch.distributed.all_to_all_single(fwd_recv, fwd_send, recv_counts, send_counts, group=groups.ep)
        torch.distributed.all_to_all_single(back_recv, back_send, send_counts, recv_counts, group=groups.ep)

    copies = (fwd_send.clone(), back_send.clone(), back_recv.clone())

    def floor() -> None:  # raw plus one plain memcpy per pass no dispatcher can skip
        fwd_send.copy_(copies[0])  # the gather of the token rows
        torch.distributed.all_to_all_single(fwd_recv, fwd_send, recv_counts, send_counts, group=groups.ep)
        back_send.copy_(copies[1])  # the experts writing their output rows
        torch.distributed.all_to_all_single(back_recv, back_send, send_counts, recv_counts, group=groups.ep)
        copies[2].copy_(back_recv)  # reading the returned rows back into tokens

    # identity experts: each token comes back once per rank it visited
    want = x.float() * plan_rows_per_token(plan)[:, None]
    torch.testing.assert_close(ours(), want, rtol=1e-2, atol=1e-2)
    pairs = time_interleaved([ours, raw, floor], cfg["warmup"], cfg["iters"])
    return {"pairs": pairs, "rows_sent": sum(send_counts), "row_bytes": row_bytes, "verified": True}


def plan_rows_per_token(plan: DispatchPlan) -> torch.Tensor:
    """[T] float32: rows sent per token (ranks it visits), from the plan's combine offsets."""
    ends = torch.cat([plan.combine_offsets[1:], plan.combine_offsets.new_tensor([plan.num_rows])])
    return (ends - plan.combine_offsets).float()


def time_interleaved(fns: list[Callable[[], Any]], warmup: int, iters: int) -> list[tuple[float, ...]]:
    """Per iteration, each fn once (barrier before each), so machine noise hits all alike.
    Returns one tuple of seconds per timed iteration: the slowest rank's time of each fn."""
    times = torch.zeros(iters, len(fns), dtype=torch.float64)
    for it in range(warmup + iters):
        for j, fn in enumerate(fns):
            synchronize()
            torch.distributed.barrier()
            start = time.perf_counter()
            fn()
            synchronize()
            if it >= warmup:
                times[it - warmup, j] = time.perf_counter() - start
    times = times.to(current_device())
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    return [tuple(row) for row in times.cpu().tolist()]


def time_moe_layer(rank: int, world: int, cfg: dict) -> dict:

    torch.manual_seed(0)
    layout = Layout(dp=world)
    backend = "local" if world == 1 else cfg["backend"]
    groups = build_process_groups(layout, rank, timeout=300) if world > 1 else None
    dispatcher = build_dispatcher(backend, groups, layout)
    config = moe_layer_config(cfg)
    local = list(layout.local_slots(rank, config.num_experts))
    layer = MoELayer(config, 0, dtype=torch.bfloat16, local_slots=local, dispatcher=dispatcher).to(current_device())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
        layer.set_placement(torch.arange(config.num_experts), layout.ep_size, layout.coords(rank).ep_rank)
        x = torch.randn(cfg["tokens"], config.hidden_size, device=current_device()).to(torch.bfloat16)
        seconds = time_op(lambda: layer(x), cfg["warmup"], cfg["iters"])
    return {"seconds": seconds}


def moe_layer_config(cfg: dict) -> ModelConfig:
    """DeepSeek-V3-style MoE layer of the requested sizes (no shared experts, one group)."""
    raw = build_tiny_config("deepseek_v3")
    raw.update(hidden_size=cfg["hidden"], moe_intermediate_size=cfg["inter"], n_routed_experts=cfg["experts"],
               num_experts_per_tok=cfg["topk"], n_shared_experts=0, n_group=1, topk_group=1,
               first_k_dense_replace=0)
    return ModelConfig.from_hf(raw)


def _cfg(args: argparse.Namespace) -> dict:
    return {"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk, "experts": args.experts,
            "inter": args.inter, "iters": args.iters, "warmup": args.warmup_iters, "backend": args.backend,
            "threads": args.threads}


def parse_ranks(text: str | int, experts: int) -> list[int]:
    """``--ranks`` (``"1,2,4"``) as rank counts; ValueError unless each is >= 1 and divides ``experts``."""
    ranks = [r.strip() for r in str(text).split(",") if r.strip()]
    if not ranks or not all(r.isascii() and r.isdigit() and int(r) >= 1 and experts % int(r) == 0 for r in ranks):
        raise ValueError(f"--ranks {text}: give comma-separated rank counts, each >= 1 and dividing --experts {experts}")
    return [int(r) for r in ranks]


def run(args: argparse.Namespace, spawn: Callable[..., Any]) -> dict:
    """Run the requested mode. Returns {"text": printable report, "json": dict}."""
    cfg = _cfg(args)
    if args.dispatch:
        return _report_dispatch(cfg, args.nprocs, spawn(time_dispatch, args.nprocs, cfg))
    ranks = parse_ranks(args.ranks, args.experts)
    per_world = {r: spawn(time_moe_layer, r, cfg)["seconds"] for r in ranks}
    return _report_moe_layer(cfg, per_world)


def _report_dispatch(cfg: dict, world: int, res: dict) -> dict:
    names = ("ours", "raw", "floor")
    cols = {name: [p[j] for p in res["pairs"]] for j, name in enumerate(names)}
    ratio = statistics.median(p[0] / p[1] for p in res["pairs"])
    floor_ratio = statistics.median(p[2] / p[1] for p in res["pairs"])
    q = statistics.quantiles if len(res["pairs"]) >= 4 else None
    payload = res["rows_sent"] * res["row_bytes"]
    text = "\n".join([
        f"# dispatch+combine vs raw all_to_all_single: {world} ranks, T={cfg['tokens']}/rank, "
        f"D={cfg['hidden']}, K={cfg['topk']}, E={cfg['experts']}, bf16, {len(res['pairs'])} interleaved iterations",
        f"# rank 0 sends {res['rows_sent']} rows ({res['rows_sent'] / max(cfg['tokens'], 1):.2f} per token "
        f"after dedup), {payload / 2**20:.2f} MiB out + {res['rows_sent'] * cfg['hidden'] * 2 / 2**20:.2f} MiB back",
        "# floor = raw + one plain memcpy of the payload before, between and after the two transfers",
        f"{'':>6}{'median (us)':>14}{'p25 (us)':>12}{'p75 (us)':>12}",
        *[f"{name:>6}{statistics.median(v) * 1e6:>14.1f}"
          + (f"{q(v, n=4)[0] * 1e6:>12.1f}{q(v, n=4)[2] * 1e6:>12.1f}" if q else "")
          for name, v in cols.items()],
        f"# median per-iteration ratio ours/raw: {ratio:.3f}   floor/raw: {floor_ratio:.3f}",
    ])
    return {"text": text, "json": {"mode": "dispatch", "nranks": world, **cfg, "ours_s": cols["ours"],
                                   "raw_s": cols["raw"], "floor_s": cols["floor"],
                                   "rows_sent_rank0": res["rows_sent"], "median_ratio": ratio,
                                   "median_floor_ratio": floor_ratio}}


def _report_moe_layer(cfg: dict, per_world: dict[int, float]) -> dict:
    lines = [f"# EP MoE layer (bf16): T={cfg['tokens']}/rank, D={cfg['hidden']}, I={cfg['inter']}, "
             f"K={cfg['topk']}, E={cfg['experts']}, backend {cfg['backend']} (1 rank: local), "
             f"torch threads/rank: {cfg['threads'] or 'cores / ranks'}",
             f"{'ranks':>6}{'step (ms)':>12}{'tokens/s':>12}{'tokens/s/rank':>15}"]
    rows = []
    for world, seconds in per_world.items():
        tps = world * cfg["tokens"] / seconds
        rows.append({"ranks": world, "step_ms": seconds * 1e3, "tokens_per_s": tps})
        lines.append(f"{world:>6}{seconds * 1e3:>12.2f}{tps:>12.0f}{tps / world:>15.0f}")
    return {"text": "\n".join(lines), "json": {"mode": "moe_layer", **cfg, "rows": rows}}
