"""The step's building blocks: the beam shape, tree packing, sampling and penalties, the
branching rules, and the memory formulas (``footprint``)."""
