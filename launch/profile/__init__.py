"""Expert-imbalance profiling: ``python -m launch profile run|report``.

Where does expert load pile up, how fast does it move, and what would redundant experts or
a bigger EP group buy? ``readers`` turns this project's, SGLang's and plain-array dumps into
one ``Recording``; ``analysis`` and ``whatif`` answer the questions (pure numpy, the balancer
for placements); ``plots`` and ``html_report`` draw the report folder; ``report`` writes it;
``runner`` records a live run; ``commands`` holds the two CLI entry points.

Shape legend: S recorded steps (forward passes), L MoE layers, E logical experts,
P physical slots, R EP ranks.
"""
