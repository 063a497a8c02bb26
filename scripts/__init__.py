"""Build and benchmark scripts, run by make; not part of the installed package."""
