"""``python -m launch bench quantization``: what weight-only int8 experts cost in accuracy.

    python -m launch bench quantization --model DIR [--dtype bfloat16] [--max-tokens 512]
        [--texts FILE ...] [--json FILE]

Runs the checkpoint teacher-forced over text the package ships (``launch/data/*.txt`` unless
``--texts`` names others; each file cut into ``--max-tokens`` windows) twice: routed experts
in the checkpoint's weights at ``--dtype``, then ``--quantization int8`` (per-output-channel
scales). Reports per text and overall: perplexity of each run, and top-1 agreement = the
fraction of positions whose argmax next token is the same in both runs. A float32 run is
added as the reference when ``--dtype`` is bfloat16 (so bf16's own drift is visible).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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


def evaluate(models: dict[str, torch.nn.Module], windows: list[list[int]]) -> dict[str, dict[str, float]]:
    """Per run: nll sum, token count and top-1 agreement with the first run."""
    names = list(models)
    stats = {name: {"nll": 0.0, "tokens": 0, "agree": 0} for name in names}
    for ids in windows:
        target = torch.tensor(ids[1:])
        base = None
        for name in names:
            logits = window_logits(models[name], ids)[:-1]  # [L-1, V]
            s = stats[name]
            s["nll"] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            s["tokens"] += target.numel()
            top = logits.argmax(-1)
            base = top if base is None else base
            s["agree"] += int((top == base).sum())
    return {name: {"perplexity": math.exp(s["nll"] / s["tokens"]), "top1_agreement": s["agree"] / s["tokens"],
                   "tokens": s["tokens"]} for name, s in stats.items()}


def check_args(model: str, max_tokens: int, texts: list[Path], json_path: str | None = None) -> None:
    """ValueError / FileNotFoundError naming the first flag that cannot work, before any model loads:
    --max-tokens, --json (a writable file path), --model (a directory with config.json and
    tokenizer.json), the --texts files."""
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
    parser = argparse.ArgumentParser(prog="python -m launch bench quantization", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per teacher-forced window")
    parser.add_argument("--texts", nargs="+", default=None, help="text files (default: launch/data/*.txt)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    texts = [Path(t) for t in args.texts] if args.texts else sorted(DATA_DIR.glob("*.txt"))
    try:
        check_args(args.model, args.max_tokens, texts, args.json)
        from launch.tokenizer import Tokenizer
        from moe.config import ModelConfig

        tokenizer = Tokenizer.from_dir(args.model)
        token_ids = {text: encode_text(tokenizer, text) for text in texts}
        check_token_ids(args.model, token_ids, ModelConfig.from_hf(args.model).vocab_size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    models = {args.dtype: build_model(args.model, dtype, None), f"{args.dtype}+int8": build_model(args.model, dtype, "int8")}
    if dtype != torch.float32:
        models["float32"] = build_model(args.model, torch.float32, None)
    results = {}
    for text, label in zip(texts, text_labels(texts)):
        ids = token_ids[text]
        windows = [ids[i:i + args.max_tokens] for i in range(0, len(ids) - 1, args.max_tokens)]
        results[label] = evaluate(models, [w for w in windows if len(w) > 1])
    total = {name: {"perplexity": math.exp(sum(math.log(r[name]["perplexity"]) * r[name]["tokens"]
                                                for r in results.values()) / sum(r[name]["tokens"] for r in results.values())),
                    "top1_agreement": sum(r[name]["top1_agreement"] * r[name]["tokens"] for r in results.values())
                    / sum(r[name]["tokens"] for r in results.values()),
                    "tokens": sum(r[name]["tokens"] for r in results.values())} for name in models}
    results["all"] = total
    base = next(iter(models))
    width = max(16, *(len(text) for text in results))
    print(f"{'text':>{width}} {'run':>16} {'tokens':>7} {'perplexity':>11} {'top-1 agree vs ' + base:>24}")
    for text, per_run in results.items():
        for name, r in per_run.items():
            print(f"{text:>{width}} {name:>16} {r['tokens']:>7} {r['perplexity']:>11.3f} "
                  f"{r['top1_agreement']:>24.4f}")
    if args.json:
        write_output_file(args.json, json.dumps({"model": args.model, "dtype": args.dtype, "results": results},
                                                indent=2) + "\n")
    return 0
