"""The draft sources: the protocol (``sources``), the recurrent drafter, context lookup,
draft models and the early-exit adapter, and the sources a loop holds (``held``)."""
