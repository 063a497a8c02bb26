"""The engine: model, drafter, tree packing, sampling, the decode step and loop, loading."""
