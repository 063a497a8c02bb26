"""``redrafter-mlx serve``: an OpenAI-compatible HTTP server with continuous batching.

* ``scheduler``: the engine loop (one thread owns the model and the cache) over the engine's
  ``BatchGenerator`` (``engine/loop/batch.py``: rows joining and leaving with their own sampling
  settings, the steps, exact stops); it keeps the requests, their events and the broadcast
  to other ranks;
* ``requests``: a request, the events it receives, the events rank 0 shares with the ranks;
* ``protocol``: OpenAI request parsing and validation, response and error bodies;
* ``app``: the Starlette ASGI app (endpoints, SSE streaming) and the uvicorn runner.

Dependencies point one way: cli -> serve -> engine.
"""
