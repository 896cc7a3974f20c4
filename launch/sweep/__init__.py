"""Layout sweeps: run a grid of runtime configs for real and record measured against predicted.

``grid`` parses ``key=[values]`` items and expands points; ``measure`` runs one point on the
engine and reads its counters; ``report`` writes results.jsonl / results.csv / plots;
``prediction`` asks the cost model for the same point; ``runner`` is ``python -m launch sweep``.
"""
