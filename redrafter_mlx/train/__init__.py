"""Drafter training by distillation, and its data."""
