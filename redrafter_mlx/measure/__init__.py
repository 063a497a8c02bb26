"""Measuring tools over the engine, used by ``redrafter-mlx bench`` and the tuner.

* ``throughput``: one timed generation (decode tokens/s, prefill apart), the figure both
  ``bench`` and ``tune`` compare;
* ``profile``: per-phase timings and graph-op counts of one decode step per beam shape;
* ``verify_cost``: one tree-verification pass against one autoregressive step on a random
  Llama (no trained weights needed).

This layer sits just above the engine: it imports the engine, the engine never imports it.
"""
