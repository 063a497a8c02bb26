"""The one decode loop (``batch``: prompt processing, stepping, branches, rows), the shape
choice, the plan, the memory check, loading, the run builder and the public API
(``generation``)."""
