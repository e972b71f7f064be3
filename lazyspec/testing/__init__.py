"""Tiny random models, a cache-free greedy oracle and a scripted draft head, for tests and
benchmarks that need a model without downloading one."""
