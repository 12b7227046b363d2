"""Experiments built on the library, kept apart from it: the sweeps of the paper's tables and depth claim in
miniature (`python -m experiments.sweep`). Their published outputs are under results/."""
