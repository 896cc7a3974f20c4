"""Complete random checkpoints for tests and demos: weights (``moe.tiny``) plus a tokenizer.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the text shipped in
``launch/data/*.txt``; training is deterministic, so the same (size) gives the same
``tokenizer.json``. Special tokens come first, in ``SPECIAL_TOKENS`` order, so
``<|bos|>`` = 0 and ``<|eos|>`` = 1 (``moe.tiny.BOS_TOKEN_ID`` / ``EOS_TOKEN_ID``).
``encode`` prepends ``<|bos|>`` (post-processor); ``tokenizer_config.json`` carries the
bos/eos/pad tokens and ``DEFAULT_CHAT_TEMPLATE``.

CLI: ``python -m launch make-tiny --arch deepseek_v3 --out DIR [--size tiny|small] [--seed N]
[--router-skew S] [--override KEY=VALUE ...]``.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from launch.config_args import FlagParser
from launch.paths import output_dir_problem
from launch.tokenizer import DEFAULT_CHAT_TEMPLATE
from moe.config import ModelConfig
from moe.tiny import (
    ARCHITECTURES,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    SIZES,
    build_tiny_config,
    compute_checkpoint_shapes,
    count_parameters,
)
from moe.tiny import write_tiny_checkpoint as write_tiny_weights

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
TOKENIZER_VOCAB_SIZE = {"tiny": 512, "small": 1024}
# config.json ``torch_dtype`` -> the dtype the weights are stored in (an override changes both)
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def training_texts() -> list[str]:
    """The shipped training corpus (``launch/data/*.txt``), in file-name order."""
    data = Path(__file__).resolve().parent / "data"
    texts = [p.read_text(encoding="utf-8") for p in sorted(data.glob("*.txt"))]
    if not texts:
        raise FileNotFoundError(f"no tokenizer training text (*.txt) under {data}")
    return texts


def train_tokenizer(vocab_size: int, texts: list[str] | None = None) -> tokenizers.Tokenizer:
    """Train a byte-level BPE of exactly ``vocab_size`` ids (special tokens included).

    Raises ValueError if the corpus is too small to reach ``vocab_size``.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else training_texts(), trainer)
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise ValueError(f"training text too small: reached {got} ids, asked for {vocab_size}")
    bos, eos = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
    if tok.token_to_id(bos) != BOS_TOKEN_ID or tok.token_to_id(eos) != EOS_TOKEN_ID:
        raise RuntimeError("special token ids do not match moe.tiny's BOS/EOS ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_TOKEN_ID)]
    )
    return tok


def write_tokenizer(out_dir: str | Path, tok: tokenizers.Tokenizer, *, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (HF format) into out_dir."""
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# a checkpoint's seed (moe.tiny mixes it with each layer's index into int64 generator seeds)
SEED_MAX = 2**32 - 1


def make_tiny_checkpoint(
    arch: str, out_dir: str | Path, *, size: str = "tiny", seed: int = 0, log: Callable[[str], None] | None = None,
    router_skew: float = 0.0, config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Weights + config + tokenizer: a directory ``LLM``/``from_pretrained`` can load.

    The vocab size in config.json is the trained tokenizer's (512 tiny, 1024 small).
    router_skew / config_overrides: see ``moe.tiny.write_tiny_checkpoint`` (the vocab size
    cannot be overridden: it is the tokenizer's). Everything is checked before anything is
    written (ValueError naming the problem); on failure the folders this call created are
    removed again (a folder that existed before is never removed). Writing into a folder that
    holds a checkpoint replaces it: its weight files go first (``remove_stale_weights``), so a
    sharded one's index and shards cannot outlive it; other files stay.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be in [0, 2**32 - 1], got {seed}")
    overrides = dict(config_overrides or {})
    if "vocab_size" in overrides:
        raise ValueError("config override 'vocab_size' is not allowed: the vocabulary is the trained tokenizer's")
    created = check_out_dir(out_dir)
    config = tiny_config(arch, size, overrides)
    # torch_dtype names the stored weights' dtype: write them in it, so config.json does not lie
    dtype = STORED_DTYPES[overrides.pop("torch_dtype")] if "torch_dtype" in overrides else None
    tok = train_tokenizer(TOKENIZER_VOCAB_SIZE[size])
    try:
        remove_stale_weights(out_dir)  # the new files replace a checkpoint written there before
        out = write_tiny_weights(arch, out_dir, size=size, seed=seed, vocab_size=tok.get_vocab_size(), log=log,
                                 router_skew=router_skew, config_overrides=overrides, dtype=dtype)
        write_tokenizer(out, tok, model_max_length=config["max_position_embeddings"])
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return out


# The weight files of a checkpoint (the loader reads any of them: ``moe.loading.checkpoint``).
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")


def remove_stale_weights(out_dir: str | Path) -> list[Path]:
    """Remove the weight files of a checkpoint already in ``out_dir`` (``*.safetensors`` and
    ``*.safetensors.index.json``), so that a checkpoint written there next is the one loaded: a
    sharded one's index and shards would otherwise outlive a new single ``model.safetensors``
    (and win), or old shards mix with new ones. Nothing else is touched (config.json and the
    tokenizer files are rewritten by name; other files and folders stay). Returns what it removed."""
    folder = Path(out_dir)
    if not folder.is_dir():
        return []
    stale = sorted({p for pattern in _WEIGHT_PATTERNS for p in folder.glob(pattern)
                    if p.is_symlink() or p.is_file()})
    for p in stale:
        p.unlink()
    return stale


def check_out_dir(out_dir: str | Path) -> Path | None:
    """ValueError unless ``out_dir`` is (or can be created as) a writable directory
    (``launch.paths.output_dir_problem``). Returns the outermost folder that writing it would
    create (None when it exists)."""
    problem = output_dir_problem(out_dir)
    if problem is not None:
        raise ValueError(f"--out: {problem}")
    created = Path(out_dir).absolute()
    if created.exists():
        return None
    while not created.parent.exists():
        created = created.parent
    return created


# Fields that may be null although the default is not (as in the families' own configs).
_NULLABLE = frozenset({"q_lora_rank", "rope_scaling", "sliding_window", "n_group", "topk_group"})


def _check_override_type(key: str, value: Any, default: Any) -> None:
    if value is None and (default is None or key in _NULLABLE):
        return
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        kind = "a non-negative integer"
    elif isinstance(default, float):
        ok, kind = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    elif isinstance(default, list):
        ok, kind = isinstance(value, list), "a list"
    elif isinstance(default, dict):
        ok, kind = isinstance(value, dict), "a mapping"
    else:
        return
    if not ok:
        raise ValueError(f"config override {key!r} must be {kind}{' or null' if key in _NULLABLE else ''}, "
                         f"got {json.dumps(value, default=repr)}")


def tiny_config(arch: str, size: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The config.json ``make_tiny_checkpoint`` writes, checked: each override is a field of
    the default config with a value of its type, and the result is a model the runtime
    accepts (``moe.config.ModelConfig.from_hf``) with no empty tensor. ValueError otherwise."""
    config = build_tiny_config(arch, size=size, vocab_size=TOKENIZER_VOCAB_SIZE[size])
    for key, value in overrides.items():
        if key not in config:
            raise ValueError(f"config override {key!r} is not a field of the {arch} config.json; "
                             f"fields: {sorted(config)}")
        _check_override_type(key, value, config[key])
    if "torch_dtype" in overrides and overrides["torch_dtype"] not in STORED_DTYPES:
        raise ValueError(f"config override 'torch_dtype' must be one of {list(STORED_DTYPES)} (the dtype the "
                         f"weights are written in), got {json.dumps(overrides['torch_dtype'])}")
    config.update(overrides)
    given = ", ".join(f"{k}={json.dumps(v, default=repr)}" for k, v in overrides.items())
    given = f"config override {given} gives" if len(overrides) == 1 else f"config overrides {given} give"
    try:
        ModelConfig.from_hf(config)
        if config["max_position_embeddings"] < 1:
            raise ValueError("max_position_embeddings must be positive")
        empty = next(((n, s) for n, s in compute_checkpoint_shapes(config).items() if min(s) < 1), None)
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as e:
        raise ValueError(f"{given} an invalid {arch} config: {e}") from None
    if empty is not None:
        raise ValueError(f"{given} an invalid {arch} config: "
                         f"tensor {empty[0]} would have the empty shape {list(empty[1])}")
    return config


def parse_config_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (VALUE parsed as JSON, else kept as a string) -> (key, value)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--override expects KEY=VALUE, got {item!r}")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def main(argv: list[str] | None = None) -> int:
    """``make-tiny``: write a random checkpoint with tokenizer; prints the parameter count."""
    parser = FlagParser(prog="python -m launch make-tiny", description=main.__doc__)
    parser.add_argument("--arch", required=True, choices=ARCHITECTURES)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--size", default="tiny", choices=SIZES)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--router-skew", default=0.0, type=float, metavar="S",
                        help="bias each MoE layer's router toward a few experts (0: none; 2-4: strong)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="replace a config.json field, e.g. --override hidden_size=256 (repeatable)")
    args = parser.parse_args(argv)
    if not 0 <= args.seed <= SEED_MAX:
        parser.error(f"--seed must be in [0, 2**32 - 1], got {args.seed}")
    try:
        overrides = dict(parse_config_override(item) for item in args.override)
        out = make_tiny_checkpoint(args.arch, args.out, size=args.size, seed=args.seed,
                                   router_skew=args.router_skew, config_overrides=overrides)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((out / "config.json").read_text())
    files = len(list(out.glob("*.safetensors")))
    print(f"wrote {args.arch} {args.size} checkpoint to {out}: {count_parameters(cfg):,} parameters, "
          f"vocab {cfg['vocab_size']}, {files} weight file(s)")
    return 0
