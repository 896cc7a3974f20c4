"""``python -m launch commbench``: the collective and dispatch benchmark of ``parallel.bench.commbench``
(nccl-tests style table), with ``-J``'s output path checked as every launch command checks one
(``launch.paths``), before any rank starts."""

from __future__ import annotations

from launch.paths import output_file_problem


def main(argv: list[str]) -> int:
    """Run ``parallel.bench.commbench.main`` on ``argv``; returns its exit status."""
    from parallel.bench.commbench import main as run

    return run(argv, output_problem=output_file_problem)
