"""Tools: the benchmarks (collectives, link, inter-node, main job) run end to end on tiny
sizes, the all_reduce cost model's fits, formulas and choice of algorithm, and the type
checker (mypy, strict on transport/ and collectives/: test_types.py)."""
