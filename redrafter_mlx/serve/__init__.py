"""``redrafter-mlx serve``: an OpenAI-compatible HTTP server with continuous batching.

* ``batch_step``: the compiled decode step over a fixed set of batch rows with an ``active``
  mask and per-row sampling settings and PRNG keys;
* ``scheduler``: the engine loop (one thread owns the model and the cache), rows joining at
  step boundaries and leaving when finished or cancelled;
* ``protocol``: OpenAI request parsing and validation, response and error bodies;
* ``app``: the Starlette ASGI app (endpoints, SSE streaming) and the uvicorn runner.

Dependencies point one way: cli -> serve -> engine.
"""
