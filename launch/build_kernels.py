"""``python -m launch build-kernels``: compile the CPU expert kernel ahead of first use.

    python -m launch build-kernels [--verbose]

Builds ``moe/kernels`` with torch's extension tooling into its cache directory
(``$MOE_KERNEL_CACHE`` or ``~/.cache/moe_kernels/<source hash>-<torch>-<python>-<machine>``)
and prints the directory and the instruction set this CPU will run. ``make setup`` runs it,
so the first model load does not pay the compile. Exit 1 when the build fails (the runtime
then uses the PyTorch expert path).
"""

from __future__ import annotations

import argparse
import sys
import time

from launch.config_args import FlagParser


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="python -m launch build-kernels", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    from moe import kernels

    started = time.perf_counter()
    try:
        directory = kernels.build(verbose=args.verbose)
    except Exception as e:  # compiler missing or failing: say so in one line
        print(f"error: building the CPU expert kernel failed: {kernels.build_failure(e)}", file=sys.stderr)
        return 1
    isa, rate, gains, asks_gain = kernels.settled()  # the CPU's probes run once here, kept for every later process
    dot = f", bf16 dot product at {rate:.2f}x the fp32 FMA rate" if rate else ""
    if rate and isa not in kernels.DOT_ISAS:  # measured, but a forced instruction set without dot tiles runs
        dot += f" (not used: isa {isa} has no dot tiles)"
    if (modes := kernels.tile_modes_text(gains)) is not None:  # each mode's probed speed over the default's
        dot += f", weight streams [{modes}]"
    if (asks := kernels.attention_asks_text()) is not None:
        dot += f", decode attention asks {asks} ({asks_gain:.2f}x the default's speed)"
    print(f"moe kernels: {directory} (isa {isa}{dot}, {time.perf_counter() - started:.1f} s)")
    return 0
