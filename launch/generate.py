"""``python -m launch generate --model DIR --input IN.jsonl --output OUT.jsonl [flags]``.

Input lines: ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or ``{"messages": [...]}`` (a chat
conversation, rendered with the checkpoint's chat template as the server renders a chat
request), optionally with sampling
fields (every ``SamplingParams`` field: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``n``, ``logprobs``, the
penalties, ``min_tokens``, ``logit_bias`` as OpenAI's ``{"token id": bias}`` or ``[[id, bias], ...]``,
...); a line may not give a field twice. A field a line leaves out takes ``--max-tokens`` /
``--temperature``, else the model's generation config (``--generation-config``, as vLLM), else
the ``SamplingParams`` default. Output lines repeat the input and add
``text``, ``token_ids``, ``finish_reason`` (lists of them when n > 1 under ``outputs``). With
``"logprobs": N`` each completion also has, per generated token, ``token_logprobs`` (the
log-probability of the token in ``token_ids``) and ``top_logprobs`` (the N most likely
``[token_id, logprob]`` pairs, best first; empty lists for N = 0), and ``cumulative_logprob``
(the sum of ``token_logprobs``). With ``"prompt_logprobs": N`` the line also gets
``prompt_logprobs``: ``token_logprobs`` and ``top_logprobs`` over the prompt's tokens (null and []
for the first). Logprobs are the model's raw ones (before temperature etc.).

Everything that can be checked is checked before any output is produced: the paths, every
input line (errors name the file and its physical line, ``IN.jsonl:4: ...``), the model and
the memory budget, then each prompt against the loaded engine's limits (vocabulary,
``max_model_len``, KV pool). A problem is one ``error: ...`` line on stderr and exit code 2.
A ``max_tokens`` past what ``max_model_len`` leaves after the prompt is not an error here (the
server refuses it with a 400, as vLLM's does): the completion stops at ``max_model_len`` with
``finish_reason`` "length", as vLLM's offline ``LLM`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launch.cli import EXIT_FAILED
from launch.config_args import FlagParser, add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError
from launch.core import CompletionOutput, SamplingParams
from launch.core.outputs import top_n
from launch.core.sampling_params import token_id_of_key
from launch.paths import output_file_problem
from launch.tokenizer import check_prompt

if TYPE_CHECKING:
    from launch.engine import LLMEngine

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_PROMPT_FIELDS = {"prompt", "prompt_token_ids", "messages"}


@dataclasses.dataclass(frozen=True)
class InputLine:
    """One request of the input: its physical line number (1-based), the parsed row, its params."""

    line: int
    row: dict[str, Any]
    params: SamplingParams


def check_input_file(path: str | Path) -> None:
    """ValueError unless ``path`` is a readable regular file. Give the flag's string as typed: ``Path("")``
    is ``.``, which would read as a directory rather than the empty path it was."""
    if not os.fspath(path):
        raise ValueError("--input: an empty path")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--input {path}: no such file")
    if path.is_dir():
        raise ValueError(f"--input {path} is a directory; expected a JSONL file")
    if not path.is_file():
        raise ValueError(f"--input {path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"--input {path} is not readable")


def check_output_path(path: str | Path, input_path: str | Path | None = None) -> None:
    """ValueError unless ``path`` can be written as a file (``launch.paths.output_file_problem``) and
    is not the input. Give the flags' strings as typed, as to ``check_input_file``."""
    if not os.fspath(path):
        raise ValueError("--output: an empty path")
    path = Path(path)
    if input_path and path.exists() and Path(input_path).exists() and os.path.samefile(path, input_path):
        raise ValueError(f"--output {path} is the input file; write the completions elsewhere")
    problem = output_file_problem(path)
    if problem is not None:
        raise ValueError(f"--output: {problem}")


def read_requests(path: Path, defaults: dict[str, Any] | None = None,
                  sources: dict[str, str] | None = None) -> list[InputLine]:
    """Parse and validate the JSONL input (blank lines skipped); errors name the physical line.
    ``defaults``: sampling fields for lines that do not set them (``sources``: where each came from)."""
    rows = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
            except _DuplicateKey as e:
                raise ValueError(f"{where}: field {e} is given twice") from None
            if not isinstance(row, dict):
                kind = {list: "an array", str: "a string", bool: "a boolean",
                        type(None): "null"}.get(type(row), "a number")
                raise ValueError(f"{where}: a line must be a JSON object, got {kind}")
            if sum(k in row for k in _PROMPT_FIELDS) != 1:
                raise ValueError(f"{where}: each line needs exactly one of 'prompt', 'prompt_token_ids' or 'messages'")
            unknown = set(row) - _SAMPLING_FIELDS - _PROMPT_FIELDS - {"id"}
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
            check_prompt(row, where)
            rows.append(InputLine(n, row, sampling_params_for(row, defaults or {}, where, sources)))
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


class _DuplicateKey(Exception):
    """A JSON object names one key twice (``json.loads`` keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(repr(key))
        out[key] = value
    return out


def _json_logit_bias(value: Any) -> Any:
    """A JSON line's ``logit_bias`` object: its keys are strings in JSON, so decimal ones ("77", as
    OpenAI's API spells them) become token ids; anything else is left for SamplingParams to refuse."""
    if not isinstance(value, dict):
        return value
    return {token if (token := token_id_of_key(k)) is not None else k: v for k, v in value.items()}


def sampling_params_for(row: dict[str, Any], defaults: dict[str, Any], where: str,
                        sources: dict[str, str] | None = None) -> SamplingParams:
    """The line ``row``'s SamplingParams over ``defaults`` (fields the line leaves out); ValueError
    naming ``where``, and for each default the message names, where it came from (``sources``:
    field -> e.g. "--max-tokens")."""
    given = {k: v for k, v in row.items() if k in _SAMPLING_FIELDS}
    if "logit_bias" in given:
        given["logit_bias"] = _json_logit_bias(given["logit_bias"])
    try:
        return SamplingParams(**{**defaults, **given})
    except (TypeError, ValueError) as e:
        inherited = [f"{k}={defaults[k]!r} comes from {(sources or {}).get(k, 'the defaults')}"
                     for k in defaults if k not in given and re.search(rf"\b{k}\b", str(e))]
        note = f" ({'; '.join(inherited)})" if inherited else ""
        raise ValueError(f"{where}: {e}{note}") from e


def prompt_ids(row: dict[str, Any], engine: LLMEngine) -> list[int]:
    """The token ids the engine runs for ``row`` (a conversation rendered with the chat template,
    no second bos); ValueError when a text prompt or a conversation has no tokenizer, or the
    template refuses the messages."""
    if "prompt_token_ids" in row:
        return list(row["prompt_token_ids"])
    field = "messages" if "messages" in row else "prompt"
    if engine.tokenizer is None:
        raise ValueError(f"'{field}' needs the checkpoint's tokenizer.json, which this model lacks; "
                         "pass 'prompt_token_ids'")
    if field == "messages":
        return engine.tokenizer.encode_chat(row["messages"])
    return engine.tokenizer.encode(row["prompt"])


def completion_record(c: CompletionOutput, num_logprobs: int | None = None) -> dict[str, Any]:
    """One completion as written to the output; with logprobs (``num_logprobs``: the request's
    ``logprobs``) also ``token_logprobs``, ``top_logprobs`` and ``cumulative_logprob``."""
    record: dict[str, Any] = {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
    if c.logprobs is not None:
        n = num_logprobs or 0
        record["token_logprobs"] = [entry.get(t) for t, entry in zip(c.token_ids, c.logprobs)]
        record["top_logprobs"] = [[[i, lp] for i, lp in top_n(entry, n)] for entry in c.logprobs]
        record["cumulative_logprob"] = c.cumulative_logprob
    return record


def prompt_logprobs_record(prompt_ids: list[int], entries: list[Any], n: int) -> dict[str, Any]:
    """A request's ``prompt_logprobs`` as written to the output: ``token_logprobs`` (each prompt
    token's log-probability given the tokens before it; null for the first) and ``top_logprobs``
    (the n most likely ``[token_id, logprob]`` pairs at each position; empty for the first)."""
    return {"token_logprobs": [None if e is None else e.get(t) for t, e in zip(prompt_ids, entries)],
            "top_logprobs": [[] if e is None else [[i, lp] for i, lp in top_n(e, n)] for e in entries]}


def _error(problem: object) -> int:
    print("error: " + " ".join(str(problem).splitlines()), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="python -m launch generate", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    # str, not Path: Path("") is ".", so an empty --input/--output would read as a directory
    parser.add_argument("--input", required=True, help="JSONL of prompts")
    parser.add_argument("--output", required=True, help="JSONL written with the completions")
    parser.add_argument("--max-tokens", type=int, default=None, help="default max_tokens per request")
    parser.add_argument("--temperature", type=float, default=None, help="default temperature (0 = greedy)")
    add_runtime_args(parser, server=False)  # no server here: --host, --port, --api-key ... would do nothing
    args = parser.parse_args(argv)
    try:
        config = runtime_config_from_args(args)
        check_input_file(args.input)
        check_output_path(args.output, args.input)
        args.input, args.output = Path(args.input), Path(args.output)
        defaults, sources = {}, {}
        for flag, key, value in (("--max-tokens", "max_tokens", args.max_tokens),
                                 ("--temperature", "temperature", args.temperature)):
            if value is not None:
                sampling_params_for({key: value}, {}, flag)
                defaults[key], sources[key] = value, flag
        requests = read_requests(args.input, defaults, sources)
        from launch.engine import check_runtime_config

        # under the flags, the model's generation config (as vLLM's LLM.get_default_sampling_params)
        model_defaults = check_runtime_config(config).default_sampling
        if model_defaults:
            merged = {**model_defaults, **defaults}
            overrides = config.engine.override_generation_config
            folder = config.model if config.engine.generation_config == "auto" else config.engine.generation_config
            sources = {**{k: "--override-generation-config" if k in overrides else
                          str(Path(folder) / "generation_config.json") for k in model_defaults}, **sources}
            requests = [dataclasses.replace(req, params=sampling_params_for(req.row, merged, f"{args.input}:{req.line}",
                                                                            sources))
                        for req in requests]
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return _error(e)
    from launch.core.sampling_params import truncate_prompt
    from launch.llm import LLM
    from moe.loading.errors import LoadError

    started = time.perf_counter()
    try:
        llm = LLM(config=config)
    except LoadError as e:
        return _error(e)
    try:
        prompts, checked = [], []
        for req in requests:
            try:
                ids = truncate_prompt(prompt_ids(req.row, llm.engine), req.params.truncate_prompt_tokens,
                                      llm.engine.max_model_len)
                checked.append(llm.engine.check_request(ids, req.params))  # bad_words encoded once
            except ValueError as e:
                return _error(f"{args.input}:{req.line}: {e}")
            prompts.append({"prompt_token_ids": ids, **({"prompt": req.row["prompt"]} if "prompt" in req.row else {})})
        outputs = llm.generate(prompts, checked, use_tqdm=sys.stderr.isatty())
    finally:
        llm.shutdown()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as f:
        for req, out in zip(requests, outputs):
            comps = [completion_record(c, req.params.logprobs) for c in out.outputs]
            record = {**req.row, **comps[0]} if len(comps) == 1 else {**req.row, "outputs": comps}
            if out.prompt_logprobs is not None:
                record["prompt_logprobs"] = prompt_logprobs_record(out.prompt_token_ids, out.prompt_logprobs,
                                                                   req.params.prompt_logprobs or 0)
            f.write(json.dumps(record) + "\n")
    completions = [c for o in outputs for c in o.outputs]  # n per request
    generated = sum(len(c.token_ids) for c in completions)
    seconds = time.perf_counter() - started
    print(f"wrote {len(completions)} completions for {len(outputs)} requests ({generated} tokens) to {args.output} "
          f"in {seconds:.1f}s")
    failed = [req.line for req, out in zip(requests, outputs) if any(c.finish_reason == "error" for c in out.outputs)]
    if failed:  # a worker fault ended them (the log says which rank and why): not a run to take as done
        lines = ", ".join(str(n) for n in failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
        print(f"error: generate: {len(failed)} of {len(outputs)} requests were cut short by a worker fault "
              f"(finish_reason \"error\" in {args.output}; input lines {lines}): run them again", file=sys.stderr)
        return EXIT_FAILED
    return 0
