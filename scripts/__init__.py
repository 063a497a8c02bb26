"""Builders of the shipped artefacts and benchmarks (see scripts/README.md); not installed."""
