"""``train-tiny``: train a small MoE language model on the shipped text, on CPU, in minutes.

    python -m launch train-tiny --arch deepseek_v3 --out DIR [--steps N] [--minutes M] [--seed S]

The model has the layout ``make-tiny`` writes (a few million parameters, ``TRAIN_DIMS``) and
the same byte-level BPE tokenizer; training is next-token cross-entropy with no auxiliary
load-balancing loss, so routers specialise as real models' do: some experts run hot, layers
differ, and the hot set moves with the kind of text (prose, code, tables, French).
DeepSeek-V3 keeps its routing (sigmoid scores, expert groups, ``e_score_correction_bias``);
the bias is trained DeepSeek's auxiliary-loss-free way: after each step, each expert's bias
moves by ``--bias-update-rate`` toward balance (down when over-loaded, up when under-loaded).
A small rate leaves the skew real models show.

Output: the checkpoint (config.json, generation_config.json, model.safetensors, tokenizer
files) written by ``moe.tiny.save_checkpoint``, plus ``training.json`` (arguments, losses,
per-kind expert load of the final model). Same arguments and seed, same machine: same weights.
The files reach ``--out`` only when the run has finished: a failed run leaves it as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from launch.config_args import FlagParser
from launch.paths import output_dir_problem
from launch.tiny_checkpoint import (
    TOKENIZER_VOCAB_SIZE,
    remove_stale_weights,
    train_tokenizer,
    write_tokenizer,
)
from launch.tokenizer import Tokenizer
from launch.training.corpus import TokenWindows, load_corpus
from launch.training.model import TrainableMoE
from launch.training.report import routing_report
from moe.config import ModelConfig
from moe.tiny import build_tiny_config, count_parameters, save_checkpoint

TRAIN_ARCHITECTURES = ("deepseek_v3", "mixtral", "qwen3_moe")
# Width/depth (keys of moe.tiny's size table) of the trained models: ~2-3 M parameters.
TRAIN_DIMS: dict[str, dict[str, int]] = {
    "deepseek_v3": dict(hidden=128, heads=4, layers=5, dense_inter=256, moe_inter=64, experts=16, top_k=2,
                        n_group=4, topk_group=2, q_lora=64, kv_lora=32, nope=16, rope=16, v=16),
    "mixtral": dict(hidden=128, heads=4, kv_heads=2, mixtral_layers=4, mixtral_inter=128, mixtral_experts=8),
    "qwen3_moe": dict(hidden=128, heads=4, kv_heads=2, layers=5, head_dim=32, dense_inter=256, moe_inter=64,
                      experts=16, top_k=2),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_BIAS_UPDATE_RATE = 5e-4
BIAS_ARCHITECTURES = ("deepseek_v3",)  # routers with an e_score_correction_bias (auxiliary-loss-free balancing)


def _no_bias(arch: str) -> str:
    return (f"--bias-update-rate moves DeepSeek-V3's e_score_correction_bias; --arch {arch} routes without one: "
            "leave the flag out")


@dataclass(frozen=True)
class TrainArgs:
    """One training run. ``minutes`` (if set) stops it early; the learning-rate schedule then
    follows whichever of steps and time runs out first."""

    arch: str
    out: str
    steps: int = 400
    minutes: float | None = None
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    bias_update_rate: float = DEFAULT_BIAS_UPDATE_RATE  # ignored where the router has no correction bias
    dtype: str = "float32"
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in TRAIN_ARCHITECTURES:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {', '.join(TRAIN_ARCHITECTURES)}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.minutes is not None and not self.minutes > 0:  # not >: NaN too
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if not (math.isfinite(self.lr) and self.lr > 0):  # NaN and inf fail too
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.bias_update_rate) and self.bias_update_rate >= 0):
            raise ValueError(f"--bias-update-rate must be a finite number >= 0, got {self.bias_update_rate}")
        if self.arch not in BIAS_ARCHITECTURES and self.bias_update_rate not in (0.0, DEFAULT_BIAS_UPDATE_RATE):
            raise ValueError(_no_bias(self.arch))
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(_DTYPES)}")


def build_train_config(arch: str, dtype: str = "float32") -> dict:
    """The config.json dict of the trained model of ``arch`` (vocab = the tiny tokenizer's)."""
    return build_tiny_config(arch, size="tiny", vocab_size=TOKENIZER_VOCAB_SIZE["tiny"], dtype=_DTYPES[dtype],
                             dims=TRAIN_DIMS[arch])


def learning_rate(args: TrainArgs, progress: float, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr`` at progress 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def apply_bias_update_(model: TrainableMoE, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias_e += rate * sign(mean load - load_e)
    per MoE layer, from the last forward's expert counts."""
    for m, counts in zip(model.moe_layers(), model.last_expert_counts):
        bias = m.gate.e_score_correction_bias
        if bias is not None:
            c = counts.float()
            bias.add_(rate * torch.sign(c.mean() - c))


def _step(model: TrainableMoE, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    logits = model(ids[:, :-1])  # [B, S, V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def train(args: TrainArgs, *, progress: bool = True, report_prompts: int | None = None) -> dict:
    """Run ``args`` and write the checkpoint to ``args.out``. Returns the training summary
    (also written to ``training.json``); its routing report uses the first ``report_prompts``
    prompts of each workload (all by default).

    ``args.out`` (and its missing parents) is made first, so that a path that cannot be a folder
    fails before training; every file is written into a hidden ``.train-tiny-*`` folder inside it
    and moved into place only once the run has finished. A run that fails leaves ``args.out`` as
    it was (folders it made are removed again; files of the same name are replaced only by a
    finished run, which also removes the weight files of a checkpoint written there before, e.g.
    a sharded one's index and shards, ``remove_stale_weights``; other files are never touched).
    ``args.out`` must be a usable folder (``check_out``: not empty, ...), checked before anything
    is made. A process killed outright (SIGKILL) can leave its hidden staging folder behind in
    ``args.out``."""
    check_out(args.out)
    out = Path(args.out)
    made = _make_dirs(out)
    staging = Path(tempfile.mkdtemp(prefix=".train-tiny-", dir=out))
    finished = False
    try:
        summary = _train_into(args, staging, progress, report_prompts)
        _move_into(staging, out)
        finished = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not finished:
            for folder in reversed(made):  # deepest first; stops at one that is not empty
                try:
                    folder.rmdir()
                except OSError:
                    break
    return summary


def check_out(out_dir: str) -> None:
    """ValueError (naming ``--out``) unless ``out_dir`` can take the checkpoint: not empty (that
    would write into the current folder), not a file or a dangling symbolic link, a writable folder
    or creatable under one (``launch.paths.output_dir_problem``, as make-tiny checks)."""
    out = Path(out_dir)
    if out_dir and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out_dir and out.is_symlink() and not out.exists():
        raise ValueError(f"--out {out} is a symbolic link to a folder that does not exist")
    problem = output_dir_problem(out_dir)
    if problem is not None:
        raise ValueError(f"--out {out_dir or repr(out_dir)}: {problem}")


def _make_dirs(out: Path) -> list[Path]:
    """Make ``out`` and its missing parents; returns the folders made, outermost first."""
    missing = []
    folder = out.absolute()
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"--out {out}: {folder} is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _move_into(staging: Path, out: Path) -> None:
    """Move every file of ``staging`` into ``out`` (created if missing), replacing files of
    the same name; checked first, so that a name taken by a folder moves nothing. The weight
    files of a checkpoint written there before (``remove_stale_weights``) go first."""
    files = sorted(staging.iterdir())
    taken = [f.name for f in files if (out / f.name).is_dir()]
    if taken:
        raise ValueError(f"--out {out} holds folders named {taken}, where the checkpoint's files go")
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_weights(out)  # a sharded checkpoint there before: its index and shards would win
    for f in files:
        os.replace(f, out / f.name)


def _train_into(args: TrainArgs, out: Path, progress: bool, report_prompts: int | None) -> dict:
    """train()'s run, writing every file into ``out`` (the staging folder)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    hf_tok = train_tokenizer(TOKENIZER_VOCAB_SIZE["tiny"])
    config = build_train_config(args.arch, args.dtype)
    write_tokenizer(out, hf_tok, model_max_length=config["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = Tokenizer.from_dir(out)
    windows = TokenWindows(tok, load_corpus())
    windows.check_seq_len(args.seq_len)  # before any step: a bad --seq-len fails at once
    model = TrainableMoE(ModelConfig.from_hf(config))
    model.init_weights_(args.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed + 1)
    limit = None if args.minutes is None else args.minutes * 60.0
    t0, losses, ema = time.perf_counter(), [], None
    # The with closes the bar (ending its line) also when a step raises, so an error starts its own line.
    with tqdm(total=args.steps, desc=f"train-tiny {args.arch}", unit="step", disable=not progress) as bar:
        for step in range(args.steps):
            elapsed = time.perf_counter() - t0
            if limit is not None and elapsed >= limit and losses:  # --minutes: always at least one step
                break
            frac = max(step / args.steps, 0.0 if limit is None else elapsed / limit)
            for group in opt.param_groups:
                group["lr"] = learning_rate(args, frac, step)
            ids, _ = windows.sample(gen, args.batch_size, args.seq_len)
            loss = _step(model, opt, ids)
            if args.bias_update_rate:
                apply_bias_update_(model, args.bias_update_rate)
            losses.append(loss)
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            bar.set_postfix(loss=f"{ema:.3f}")
            bar.update(1)
    model.eval()
    save_checkpoint(config, model.hf_state_dict(), out)
    summary = {
        "command": "python -m launch train-tiny " + " ".join(_as_argv(args)),
        "args": {**asdict(args), **({} if args.arch in BIAS_ARCHITECTURES else {"bias_update_rate": None})},
        "parameters": count_parameters(config),
        "steps_run": len(losses),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "corpus_tokens": windows.num_tokens(),
        "loss_first": losses[0] if losses else None,
        "loss_last_50": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "routing": routing_report(model, tok, max_prompts=report_prompts),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _as_argv(args: TrainArgs) -> list[str]:
    argv = ["--arch", args.arch, "--out", args.out, "--steps", str(args.steps), "--seed", str(args.seed)]
    if args.minutes is not None:
        argv += ["--minutes", str(args.minutes)]
    defaults = TrainArgs(arch=args.arch, out=args.out)
    for name in ("batch_size", "seq_len", "lr", "bias_update_rate", "dtype", "threads"):
        if getattr(args, name) != getattr(defaults, name):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


def _parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m launch train-tiny",
                                description="train a small MoE on the shipped text (CPU, minutes)")
    d = TrainArgs(arch="deepseek_v3", out="")
    p.add_argument("--arch", required=True, choices=TRAIN_ARCHITECTURES)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--minutes", type=float, default=None, help="stop after this much wall time")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (after bos)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--bias-update-rate", type=float, default=None,
                   help="DeepSeek-V3 e_score_correction_bias step per optimizer step (0: frozen at 0; default "
                        f"{d.bias_update_rate}); --arch deepseek_v3 only")
    p.add_argument("--dtype", default=d.dtype, choices=tuple(_DTYPES), help="stored weight dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m launch train-tiny``."""
    ns = _parser().parse_args(argv)
    try:
        args = TrainArgs(arch=ns.arch, out=ns.out, steps=ns.steps, minutes=ns.minutes, seed=ns.seed,
                         batch_size=ns.batch_size, seq_len=ns.seq_len, lr=ns.lr,
                         bias_update_rate=DEFAULT_BIAS_UPDATE_RATE if ns.bias_update_rate is None else
                         ns.bias_update_rate, dtype=ns.dtype, threads=ns.threads)
        if ns.bias_update_rate is not None and args.arch not in BIAS_ARCHITECTURES:
            raise ValueError(_no_bias(args.arch))
        summary = train(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.arch}: {summary['parameters']:,} parameters, {summary['steps_run']} steps in "
          f"{summary['train_seconds']} s, loss {summary['loss_first']:.3f} -> {summary['loss_last_50']:.3f}")
    for kind, r in summary["routing"]["kinds"].items():
        bal = " ".join(f"{b:.2f}" for b in r["balancedness"])
        print(f"  {kind:<7} loss {r['loss']:.3f}  balancedness per MoE layer (EP={r['ep']}): {bal}")
    print(f"wrote {args.out}")
    return 0
