"""Benchmarks (not run by the test suite); results go to docs/BENCHMARKS.md."""
