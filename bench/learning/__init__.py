"""Benchmarks: learning (bench/README.md maps each script to its BENCHMARKS.md section)."""
