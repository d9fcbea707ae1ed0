"""Benchmark helpers shared by `benchmarks/` scripts (and, later, `quickdraft bench` / `tune`)."""
