"""``redrafter-mlx serve``: an OpenAI-compatible HTTP server with continuous batching (and
the Anthropic Messages API).

* ``scheduler``: the engine loop (one thread owns the model and the cache) over the engine's
  ``BatchGenerator`` (``engine/loop/batch.py``: rows joining and leaving with their own sampling
  settings, the steps, exact stops); it keeps the requests, their events and the broadcast
  to other ranks;
* ``requests``: a request, the events it receives, the events rank 0 shares with the ranks;
* ``protocol``: OpenAI request parsing and validation, response bodies; ``errors``: the
  refusals; ``messages``: a chat's messages and prompt; ``tools``: its tool fields;
* ``text``: an answer's text as it streams, cut at stop strings; ``channels``: that text
  split into content, reasoning and tool calls (mlx-lm's state machine and tool parsers);
* ``anthropic``: the Anthropic Messages API's requests, read into the same chat requests;
  ``anthropic_reply``: its answers (content blocks, stream events) and errors;
* ``app``: the Starlette ASGI app (endpoints, SSE streaming); ``runner``: uvicorn.

Dependencies point one way: cli -> serve -> engine.
"""
