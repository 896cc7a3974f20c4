"""``python -m launch submit [ray job submit flags] -- ENTRYPOINT``: ``ray job submit`` that works
when the cluster uses Ray's token authentication.

Ray 2.60's ``ray start --head`` turns token authentication on whenever the head has a token
(``~/.ray/auth_token``, written by ``ray get-auth-token --generate`` or by any earlier local
``ray.init()``), but the ``ray job submit`` client sends no token unless ``RAY_AUTH_MODE=token``
is set, and fails with "Missing authentication token". This wrapper asks the cluster's
dashboard (``GET /api/version``) first:

- 401/403: the cluster wants a token. With ``RAY_AUTH_MODE`` unset it switches the client to
  token mode when a token is at hand (``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``,
  or ``~/.ray/auth_token``, where Ray itself looks), and otherwise stops with a one-line error
  saying how to fetch the token from the head (``ray get-auth-token``).
- 200: the cluster runs without authentication; the command is passed on as is.
- no answer, or an answer that is not HTTP (the GCS port given for the dashboard's): a one-line
  error naming the address.

When the client is to send a token, the dashboard is asked once more with it: a 403 (a token of
another head, a stale ``~/.ray/auth_token``) is a one-line error naming where the token came from,
not the traceback Ray's client prints.

Then it runs ``ray job submit`` with the same arguments (the ``ray`` next to this Python),
passing its output through, and returns its exit code. A head that has just started may not
have its job agent yet ("No available agent to submit job, please try again later": nothing
was submitted); the wrapper then tries again every 5 s for up to ``AGENT_WAIT_S``. Every ``ray job submit`` flag works (``--address``, ``--working-dir``,
``--runtime-env-json``, ``--no-wait``, ...); the address comes from ``--address``, else
``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``, else ``http://127.0.0.1:8265``.
It must be the dashboard's http(s) URL (or a bare ``HOST:PORT``, taken as http) with a numeric
port if it names one, or ``auto`` (the cluster running on this machine); anything else
(``ray://``, the Ray Client address; another scheme; a malformed URL) is a one-line error before
anything runs. Ray 2.60's own CLI lets ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS`` override
``--address`` and reads a bare ``HOST:PORT`` as a GCS address, so it is handed the checked URL as
``--address`` and neither variable (``pin_address``): it submits to the dashboard that was asked.
``auto`` is passed on as it came (Ray finds the local cluster through its GCS; the token is then
looked for here, as ``ray start`` on the head does); ``--address auto`` drops the variables too.
"""

from __future__ import annotations

import difflib
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
EXIT_USAGE = 2
AGENT_WAIT_S = 120.0
NO_AGENT = "No available agent to submit job"

USAGE = """usage: python -m launch submit [ray job submit flags] -- ENTRYPOINT...

`ray job submit` with Ray's token authentication handled (see the module doc):
  python -m launch submit --address http://HEAD:8265 --working-dir . -- \\
      python -m launch generate --model DIR --input IN.jsonl --output OUT.jsonl
Flags are `ray job submit`'s (`ray job submit --help`)."""


class SubmitError(RuntimeError):
    """A problem the user can fix (no cluster at the address, no token): one line, exit 2."""


def unknown_flag(args: Sequence[str]) -> str | None:
    """The first flag before ``--`` that ``ray job submit`` does not take, with a did-you-mean
    hint, or None. Checked first: a misspelt ``--adress`` would otherwise send the probe to the
    default address and blame the cluster. None too when Ray's CLI cannot be read here."""
    try:
        from ray.dashboard.modules.job.cli import submit as ray_submit
    except Exception:  # noqa: BLE001 - no Ray CLI to check against: `ray job submit` says it
        return None
    takes_value = {o: not getattr(p, "is_flag", False) for p in ray_submit.params for o in p.opts if o.startswith("-")}
    flags = list(args[: args.index("--")] if "--" in args else args)
    skip = False
    for arg in flags:
        if skip:
            skip = False
            continue
        if not arg.startswith("-"):
            continue
        name = arg.split("=", 1)[0]
        if name in takes_value:
            skip = takes_value[name] and "=" not in arg
            continue
        close = difflib.get_close_matches(name, list(takes_value), n=1)
        return f"`ray job submit` has no flag {name}" + (f" (did you mean {close[0]}?)" if close else "")
    return None


def _flag_values(args: Sequence[str], name: str) -> list[str]:
    """Every value given to flag ``name`` before ``--`` (``--flag VALUE`` or ``--flag=VALUE``); a
    ``--flag`` with nothing after it is left to Ray's CLI."""
    flags = list(args[: args.index("--")] if "--" in args else args)
    values = []
    for i, arg in enumerate(flags):
        if arg == name and i + 1 < len(flags):
            values.append(flags[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
    return values


def runtime_env_problem(args: Sequence[str]) -> str | None:
    """Why ``--working-dir`` or ``--runtime-env-json`` cannot work, naming the flag and its value,
    or None: checked here before the dashboard is asked anything (Ray's CLI finds out only after).
    A working dir with no ``://`` (a remote URI, which only the cluster can fetch) must be an
    existing local directory or .zip file; the runtime env JSON must parse to an object."""
    for value in _flag_values(args, "--working-dir"):
        if not value:
            return "--working-dir: an empty path"
        if "://" in value:
            continue
        path = Path(value)
        if not path.exists():
            return f"--working-dir {value}: no such directory"
        if not path.is_dir() and not (path.is_file() and path.suffix == ".zip"):
            return f"--working-dir {value}: not a directory (nor a .zip file)"
    for value in _flag_values(args, "--runtime-env-json"):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            return f"--runtime-env-json {value!r}: not valid JSON ({e})"
        if not isinstance(parsed, dict):
            return f"--runtime-env-json {value!r}: must be a JSON object, e.g. '{{\"pip\": [\"requests\"]}}'"
    return None


def _given_address(args: Sequence[str], env: Mapping[str, str]) -> tuple[str, str]:
    """(the address as the user gave it, where it came from: ``--address``, an environment
    variable, or the default), in the order Ray's CLI looks."""
    flags = list(args[: args.index("--")] if "--" in args else args)
    address = None
    for i, arg in enumerate(flags):
        if arg == "--address":
            address = flags[i + 1] if i + 1 < len(flags) else ""
        elif arg.startswith("--address="):
            address = arg.split("=", 1)[1]
    if address is not None:
        if not address.strip() or address.startswith("-"):  # `--address` with nothing after it
            raise SubmitError("--address needs a value: the head's dashboard, e.g. --address http://HEAD:8265")
        return address, "--address"
    for name in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        if env.get(name):
            return env[name], name
    return DEFAULT_ADDRESS, "the default address"


def submission_address(args: Sequence[str], env: Mapping[str, str]) -> str:
    """The dashboard address to submit to, as an http(s) URL, or "auto"."""
    address, _ = _given_address(args, env)
    return address if "://" in address or address == "auto" else f"http://{address}"


def check_address(args: Sequence[str], env: Mapping[str, str]) -> str:
    """``submission_address``, checked: an http(s) URL with a host and, when it names one, a
    numeric port (a bare ``HOST:PORT`` is http). SubmitError naming the address and where it
    came from for anything else: ``ray://`` (a Ray Client address, not the job API), another
    scheme, a malformed URL."""
    given, source = _given_address(args, env)
    where = f"{source} {given}" if source.startswith("--") else f"{source}={given}"
    address = submission_address(args, env)
    if address == "auto":
        return address
    example = "give the head's dashboard, e.g. --address http://HEAD:8265"
    scheme = address.split("://", 1)[0]
    if scheme == "ray":
        raise SubmitError(f"{where}: ray:// is a Ray Client address, not the job submission API: {example}")
    if scheme not in ("http", "https"):
        raise SubmitError(f"{where}: unsupported scheme {scheme!r} (only http:// and https://): {example}")
    try:
        parts = urllib.parse.urlsplit(address)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise SubmitError(f"{where}: not a valid dashboard URL ({e}): {example}") from None
    if not parts.hostname:
        raise SubmitError(f"{where}: no host name: {example}")
    return address


def find_auth_token(env: Mapping[str, str], home: Path | None = None) -> tuple[str, str] | None:
    """(the token Ray's client would send, where it came from), or None: RAY_AUTH_TOKEN, else
    the file at RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (non-empty, stripped)."""
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return env["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    path = Path(env["RAY_AUTH_TOKEN_PATH"]) if env.get("RAY_AUTH_TOKEN_PATH") else \
        (home or Path.home()) / ".ray" / "auth_token"
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return (token, str(path)) if token else None


def has_auth_token(env: Mapping[str, str], home: Path | None = None) -> bool:
    """Whether Ray's client would find a token: RAY_AUTH_TOKEN, the file at
    RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (non-empty)."""
    return find_auth_token(env, home) is not None


def probe_auth(address: str, timeout_s: float = 10.0) -> bool:
    """True when the dashboard at ``address`` wants a token (401/403), False when it answers
    without one; SubmitError when nothing answers, or something that is not HTTP does (the GCS
    port 6379 given for the dashboard's 8265)."""
    url = address.rstrip("/") + "/api/version"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return False
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return True
        raise SubmitError(f"the Ray dashboard at {address} answered {e.code} to {url}") from e
    except (ValueError, http.client.InvalidURL) as e:  # a URL check_address let through but http refuses
        raise SubmitError(f"{address} is not a valid dashboard URL ({e}): pass --address http://HEAD:8265") from e
    except http.client.HTTPException as e:  # e.g. BadStatusLine: a gRPC port, not the dashboard
        raise SubmitError(f"{address} answered, but not as a Ray dashboard does ({type(e).__name__}): is that the "
                          "GCS port (6379)? give the head's dashboard, e.g. --address http://HEAD:8265") from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SubmitError(f"no Ray dashboard answers at {address} ({reason}): start a head with "
                          "`ray start --head` there, or pass --address http://HEAD:8265") from e


def check_token(address: str, env: Mapping[str, str], home: Path | None = None, timeout_s: float = 10.0) -> None:
    """SubmitError when the dashboard at ``address`` refuses the token Ray's client would send
    (403, "Invalid authentication token": a token of another head, or a stale one); anything
    else is left to ``ray job submit``."""
    found = find_auth_token(env, home)
    if found is None:
        return
    token, source = found
    request = urllib.request.Request(address.rstrip("/") + "/api/version",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as e:
        if e.code != 403:
            return
    except (ValueError, OSError, http.client.HTTPException):
        return
    raise SubmitError(f"the Ray cluster at {address} refused the token from {source} (403 Invalid authentication "
                      "token): run `ray get-auth-token` on that head node, then `export RAY_AUTH_TOKEN=<token>` "
                      "and submit again")


def submit_env(address: str, env: Mapping[str, str], *, home: Path | None = None,
               wants_token: bool | None = None) -> dict[str, str]:
    """The environment for ``ray job submit``: token mode on when the cluster wants a token and
    the user has not chosen a mode. ``wants_token`` None probes the dashboard."""
    out = dict(env)
    if out.get("RAY_AUTH_MODE"):  # the user's explicit choice
        if out["RAY_AUTH_MODE"] == "token" and wants_token is None and address.startswith(("http://", "https://")):
            check_token(address, out, home)
        return out
    if address.startswith(("http://", "https://")):
        wants = probe_auth(address) if wants_token is None else wants_token
    else:
        wants = has_auth_token(out, home)  # cannot ask: behave as `ray start` does on the head
    if not wants:
        return out
    if not has_auth_token(out, home):
        raise SubmitError(
            f"the Ray cluster at {address} uses token authentication and no token was found here: "
            "run `ray get-auth-token` on the head node, then `export RAY_AUTH_TOKEN=<token>` "
            "(or save it to ~/.ray/auth_token) and submit again")
    if wants_token is None and address.startswith(("http://", "https://")):
        check_token(address, out, home)
    out["RAY_AUTH_MODE"] = "token"
    return out


def pin_address(args: Sequence[str], env: Mapping[str, str], address: str) -> tuple[list[str], dict[str, str]]:
    """The ``ray job submit`` arguments and environment that make Ray's CLI submit to ``address``
    (what ``check_address`` returned and the probe asked): every ``--address`` before ``--``
    replaced by ``--address ADDRESS``, and RAY_API_SERVER_ADDRESS / RAY_ADDRESS left out, since Ray
    lets them override the flag. "auto" from RAY_API_SERVER_ADDRESS / RAY_ADDRESS keeps the arguments and
    environment as they are (Ray reads that variable); ``--address auto`` is pinned like any other."""
    if address == "auto" and _given_address(args, env)[1] != "--address":
        return list(args), dict(env)
    split = list(args).index("--")
    flags: list[str] = []
    skip_value = False
    for arg in args[:split]:
        if skip_value:
            skip_value = False
        elif arg == "--address":
            skip_value = True
        elif not arg.startswith("--address="):
            flags.append(arg)
    child_env = {k: v for k, v in env.items() if k not in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")}
    return ["--address", address, *flags, *args[split:]], child_env


def ray_command() -> list[str]:
    """The ``ray`` CLI of this Python environment."""
    script = Path(sys.executable).parent / "ray"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("error: nothing to submit: give `ray job submit` flags and the job's command after `--`, e.g. "
              "`python -m launch submit --address http://HEAD:8265 --working-dir . -- python -m launch generate "
              "...` (`python -m launch submit --help` shows the usage)", file=sys.stderr)
        return EXIT_USAGE
    if args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if "--" not in args:
        print("error: put the job's command after `--`, e.g. `python -m launch submit --address "
              "http://HEAD:8265 --working-dir . -- python -m launch generate ...`", file=sys.stderr)
        return EXIT_USAGE
    if not args[args.index("--") + 1 :]:
        print("error: no job command after `--`: give the command the job runs, e.g. `-- python -m "
              "launch generate --model DIR --input IN.jsonl --output OUT.jsonl`", file=sys.stderr)
        return EXIT_USAGE
    problem = unknown_flag(args)
    if problem:
        print(f"error: {problem}; see `ray job submit --help`", file=sys.stderr)
        return EXIT_USAGE
    problem = runtime_env_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        address = check_address(args, os.environ)
        env = submit_env(address, os.environ)
    except SubmitError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    args, env = pin_address(args, env, address)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        rc, saw_no_agent = run_passing_output([*ray_command(), "job", "submit", *args], env)
        if rc == 0 or not saw_no_agent:
            return rc
        if time.monotonic() > deadline:
            print(f"error: the head at {address} has had no job agent for {AGENT_WAIT_S:.0f} s; its log is "
                  "<temp dir>/session_latest/logs/dashboard_agent.log (another Ray on that machine may hold "
                  "the agent's port 52365: start the head with --dashboard-agent-listen-port PORT)",
                  file=sys.stderr)
            return rc
        print(f"launch submit: the head's job agent is not up yet; trying again in 5 s "
              f"(for up to {AGENT_WAIT_S:.0f} s)", file=sys.stderr)
        time.sleep(5.0)


def run_passing_output(cmd: list[str], env: Mapping[str, str]) -> tuple[int, bool]:
    """Run ``cmd``, copying its output (stdout and stderr merged) to our stdout line by line.
    Returns (exit code, whether the output said the head had no job agent yet)."""
    saw = False
    with subprocess.Popen(cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:
            saw = saw or NO_AGENT in line
            sys.stdout.write(line)
            sys.stdout.flush()
    return proc.returncode, saw
