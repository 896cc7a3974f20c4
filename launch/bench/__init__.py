"""``python -m launch bench ...``: the benchmark commands (``launch.cli`` names them)."""

# the compute dtype `bench decode` and `bench throughput` run when --dtype is left out, whatever the
# checkpoint stores: the serving dtype the targets in docs/benchmarks.md are quoted in
BENCH_DTYPE = "bfloat16"


def repeated_value_problem(flag: str, values: list | None) -> str | None:
    """The one-line problem where ``flag`` lists a value twice (its row would run again and count
    twice in any total), else None."""
    seen: set = set()
    for value in values or ():
        if value in seen:
            return f"{flag} lists {value} twice"
        seen.add(value)
    return None
