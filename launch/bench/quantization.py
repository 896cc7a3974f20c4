"""``python -m launch bench quantization``: what weight-only int8 experts cost in accuracy.

    python -m launch bench quantization --model DIR [--dtype bfloat16] [--max-tokens 512]
        [--texts FILE ...] [--transformers] [--json FILE]

Runs the checkpoint teacher-forced over text the package ships (``launch/data/*.txt`` unless
``--texts`` names others; each file cut into ``--max-tokens`` windows) twice: routed experts
in the checkpoint's weights at ``--dtype``, then ``--quantization int8`` (per-output-channel
scales). Reports per text and overall: perplexity of each run, and top-1 agreement = the
fraction of positions whose argmax next token is the same in both runs. A float32 run is
added as the reference when ``--dtype`` is bfloat16 (so bf16's own drift is visible), and then
every run's top-1 agreement with it is reported too.

``--transformers`` adds transformers' own forward of the checkpoint (``AutoModelForCausalLM``,
eager attention, no KV cache: the model's definition) at ``--dtype``, and in float32 when
``--dtype`` is bfloat16: how far ours is from the definition, set beside how far transformers'
bf16 is from its own float32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from launch.config_args import FlagParser
from launch.paths import output_file_problem, write_output_file

if TYPE_CHECKING:
    from launch.tokenizer import Tokenizer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_model(path: str, dtype: torch.dtype, quantization: str | None) -> torch.nn.Module:
    """MoEModel loaded from ``path`` on one process, experts optionally int8."""
    from moe.config import ModelConfig
    from moe.loader import load_weights
    from moe.model import MoEModel

    config = ModelConfig.from_hf(path)
    model = MoEModel(config, dtype=dtype).eval()
    load_weights(model, path, dtype=dtype)
    for layer in model.moe_layers():
        layer.experts.set_quantization(quantization)
    return model


@torch.inference_mode()
def window_logits(model: torch.nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Teacher-forced logits of one window: ids [L] -> [L, V] float32 (one prefill)."""
    from moe.kv_cache import AttentionMetadata, PagedKVCache

    n = len(ids)
    blocks = -(-n // block_size)
    cache = PagedKVCache(model.config, blocks, block_size, model.dtype)
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], block_size)
    hidden = model(torch.tensor(ids), torch.arange(n), meta, cache)
    return model.compute_logits(hidden)


def build_transformers(path: str, dtype: torch.dtype) -> Callable[[list[int]], torch.Tensor]:
    """transformers' forward of the checkpoint (eager attention, no KV cache): ids [L] -> logits
    [L, V] float32. ValueError in one line when transformers cannot load it."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:  # ImportError: e.g. fp8 wants accelerate
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--transformers: transformers cannot load {path}: {first}") from None
    model.eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()

    return run


def run_logits(model: torch.nn.Module | Callable[[list[int]], torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [L, V] float32 of one window from one of our models (``build_model``)
    or a function of the ids (``build_transformers``)."""
    if isinstance(model, torch.nn.Module):
        return window_logits(model, ids)
    return model(ids)


def evaluate(models: dict[str, torch.nn.Module | Callable[[list[int]], torch.Tensor]],
             windows: list[list[int]]) -> dict[str, dict[str, float]]:
    """Per run: perplexity, token count, top-1 agreement with the first run, and with the run
    named "float32" where there is one (``top1_agreement_float32``)."""
    names = list(models)
    stats = {name: {"nll": 0.0, "tokens": 0, "agree": 0, "agree32": 0} for name in names}
    for ids in windows:
        target = torch.tensor(ids[1:])
        tops = {}
        for name in names:
            logits = run_logits(models[name], ids)[:-1]  # [L-1, V]
            s = stats[name]
            s["nll"] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            s["tokens"] += target.numel()
            tops[name] = logits.argmax(-1)
        for name in names:
            stats[name]["agree"] += int((tops[name] == tops[names[0]]).sum())
            if "float32" in tops:
                stats[name]["agree32"] += int((tops[name] == tops["float32"]).sum())
    out = {}
    for name, s in stats.items():
        out[name] = {"perplexity": math.exp(s["nll"] / s["tokens"]), "top1_agreement": s["agree"] / s["tokens"],
                     "tokens": s["tokens"]}
        if "float32" in models:
            out[name]["top1_agreement_float32"] = s["agree32"] / s["tokens"]
    return out


def overall(results: dict[str, dict[str, dict[str, float]]], names: list[str]) -> dict[str, dict[str, float]]:
    """The texts' results of each run pooled: perplexity over all tokens, agreements weighted by
    each text's tokens."""
    total: dict[str, dict[str, float]] = {}
    for name in names:
        runs = [r[name] for r in results.values()]
        tokens = sum(r["tokens"] for r in runs)
        total[name] = {"perplexity": math.exp(sum(math.log(r["perplexity"]) * r["tokens"] for r in runs) / tokens),
                       "top1_agreement": sum(r["top1_agreement"] * r["tokens"] for r in runs) / tokens,
                       "tokens": tokens}
        if "top1_agreement_float32" in runs[0]:
            total[name]["top1_agreement_float32"] = sum(r["top1_agreement_float32"] * r["tokens"] for r in runs) / tokens
    return total


def check_args(model: str, max_tokens: int, texts: Sequence[str | Path], json_path: str | None = None) -> None:
    """ValueError / FileNotFoundError naming the first flag that cannot work, before any model loads:
    --max-tokens, --json (a writable file path), --model (a directory with config.json and
    tokenizer.json), the --texts files (given as typed: ``Path("")`` is ``.``, a directory, where the
    user gave an empty path)."""
    from moe.config import ModelConfig

    if json_path is not None and (problem := output_file_problem(json_path)) is not None:
        raise ValueError(f"--json: {problem}")
    if max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2 (a window scores each token after the first), got {max_tokens}")
    if not Path(model).is_dir():
        raise FileNotFoundError(f"--model {model}: no such directory")
    for name in ("config.json", "tokenizer.json"):
        if not Path(model, name).is_file():
            raise FileNotFoundError(f"--model {model} has no {name}")
    if not texts:
        raise FileNotFoundError(f"no texts to score: {DATA_DIR} holds no *.txt (name files with --texts)")
    if any(not os.fspath(text) for text in texts):
        raise ValueError("--texts: an empty path")
    texts = [Path(text) for text in texts]
    for text in texts:
        if not text.is_file():
            problem = "is a directory, not a file" if text.is_dir() else "no such file"
            raise FileNotFoundError(f"--texts {text}: {problem}")
    seen: dict[Path, Path] = {}
    for text in texts:
        if (first := seen.setdefault(text.resolve(), text)) is not text:
            raise ValueError(f"--texts names one file twice: {first} and {text}")
    try:
        max_len = ModelConfig.from_hf(model).max_position_embeddings
    except ValueError as e:
        raise ValueError(f"--model {model}: {e}") from None
    if max_tokens > max_len:
        raise ValueError(f"--max-tokens {max_tokens} exceeds the model's max_position_embeddings ({max_len})")


def text_labels(texts: list[Path]) -> list[str]:
    """Each text's label in the table and the JSON: its file name, or the path as given where two
    texts share a name (a/x.txt, b/x.txt), so no text's results replace another's."""
    names = [text.name for text in texts]
    return [text.name if names.count(text.name) == 1 else str(text) for text in texts]


def encode_text(tokenizer: Tokenizer, text: Path) -> list[int]:
    """Token ids of the UTF-8 file ``text``; ValueError naming the file when it cannot be read, is
    not UTF-8 text, or has fewer than 2 tokens (nothing to score)."""
    try:
        content = text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        where = f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise ValueError(f"--texts {text} is not UTF-8 text ({where})") from None
    except OSError as e:
        raise ValueError(f"--texts {text}: {(e.strerror or str(e)).lower()}") from None
    if not content.strip():
        raise ValueError(f"--texts {text} is empty: nothing to score")
    ids = tokenizer.encode(content)
    if len(ids) < 2:
        raise ValueError(f"--texts {text} has only {len(ids)} token: a text needs at least 2 to score")
    return ids


def check_token_ids(model: str, token_ids: dict[Path, list[int]], vocab_size: int) -> None:
    """ValueError naming both numbers when the tokenizer of ``model`` produces an id the embedding
    (``vocab_size`` rows) has no row for: it would fail as an IndexError deep in the model."""
    largest, text = max((max(ids), text) for text, ids in token_ids.items())
    if largest >= vocab_size:
        raise ValueError(f"--model {model}: its tokenizer gives token id {largest} (in {text}) but config.json's "
                         f"vocab_size is {vocab_size}: tokenizer and checkpoint do not match")


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="python -m launch bench quantization", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per teacher-forced window")
    parser.add_argument("--texts", nargs="+", default=None, help="text files (default: launch/data/*.txt)")
    parser.add_argument("--transformers", action="store_true",
                        help="also run transformers' forward (eager, no KV cache) at --dtype (and float32)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    texts = [Path(t) for t in args.texts] if args.texts else sorted(DATA_DIR.glob("*.txt"))
    try:
        check_args(args.model, args.max_tokens, args.texts or texts, args.json)
        from launch.tokenizer import Tokenizer
        from moe.config import ModelConfig

        tokenizer = Tokenizer.from_dir(args.model)
        token_ids = {text: encode_text(tokenizer, text) for text in texts}
        model_config = ModelConfig.from_hf(args.model)
        check_token_ids(args.model, token_ids, model_config.vocab_size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    models = {args.dtype: build_model(args.model, dtype, None), f"{args.dtype}+int8": build_model(args.model, dtype, "int8")}
    if dtype != torch.float32:
        models["float32"] = build_model(args.model, torch.float32, None)
    if args.transformers:
        try:
            for name, d in ((f"transformers {args.dtype}", dtype), ("transformers float32", torch.float32)):
                if name not in models and (d == dtype or dtype != torch.float32):
                    models[name] = build_transformers(args.model, d)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    differs = model_config.transformers_differs() if args.transformers else None
    if differs:
        print(f"# transformers' rows are another model's: {differs}")
    results = {}
    for text, label in zip(texts, text_labels(texts)):
        ids = token_ids[text]
        windows = [ids[i:i + args.max_tokens] for i in range(0, len(ids) - 1, args.max_tokens)]
        results[label] = evaluate(models, [w for w in windows if len(w) > 1])
    results["all"] = overall(results, list(models))
    base = next(iter(models))
    width = max(16, *(len(text) for text in results))
    run_width = max(16, *(len(name) for name in models))
    head = f"{'text':>{width}} {'run':>{run_width}} {'tokens':>7} {'perplexity':>11} {'top-1 agree vs ' + base:>24}"
    with_f32 = "float32" in models and base != "float32"  # a float32 run's first column is this one already
    print(head + (f" {'vs float32':>11}" if with_f32 else ""))
    for text, per_run in results.items():
        for name, r in per_run.items():
            line = (f"{text:>{width}} {name:>{run_width}} {r['tokens']:>7} {r['perplexity']:>11.3f} "
                    f"{r['top1_agreement']:>24.4f}")
            print(line + (f" {r['top1_agreement_float32']:>11.4f}" if with_f32 else ""))
    if args.json:
        extra = {"transformers_differs": differs} if differs else {}
        write_output_file(args.json, json.dumps({"model": args.model, "dtype": args.dtype, **extra,
                                                 "results": results}, indent=2) + "\n")
    return 0
