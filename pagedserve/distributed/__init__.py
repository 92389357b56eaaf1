"""Tensor parallelism's communication: the process group the ranks talk through
(group.py). Which part of the weights a rank holds is models/sharding.py."""
