"""Runnable recipes for neuron-dist: the training "main job" and its reference."""
