"""One-off experiments and measurements behind docs/bench tables; not run by make, not installed."""
