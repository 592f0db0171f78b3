"""Tools: the benchmarks (collectives, link, inter-node, main job) run end to end on tiny
sizes, and the all_reduce cost model's fits, formulas and choice of algorithm."""
