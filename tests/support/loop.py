"""``Scripted``: a shape policy that plays a fixed script of shapes, to drive the loop."""

from __future__ import annotations


class Scripted:
    """A ``ShapePolicy`` of a type the batch has never seen: a fixed cycle of shapes."""

    each_step = False

    def __init__(self, cycle):
        self.cycle, self.shapes = list(cycle), list(dict.fromkeys(cycle))
        self.per_step = max(s.longest for s in self.shapes)
        self.slots = max(s.slots for s in self.shapes)
        self.asked, self.told, self.resets = 0, [], 0

    def shadow(self, text):
        return None

    def next(self, rows, matches, seeded):
        shape = self.cycle[self.asked % len(self.cycle)]
        self.asked += 1
        return shape

    def finished(self, rows, shape, counts, seconds):
        self.told.append((shape, list(counts)))

    def lookup_seen(self, resolved):
        pass

    def reset(self):
        self.resets += 1
