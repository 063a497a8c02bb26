"""``brute_force``: the tree's dedup / pack oracle, a trie in plain Python."""

from __future__ import annotations


def brute_force(beams, capacity):
    """Plain-Python trie: slots beam-major, first beam owning each prefix, overflow dropped."""
    W, L = len(beams), len(beams[0])
    slot_of_prefix, tokens, depth = {}, [], []
    unpacker = [[None] * L for _ in range(W)]
    prefix_tree = [[None] * L for _ in range(W)]
    owner = {}
    for i in range(W):
        for k in range(L):
            prefix = tuple(beams[i][: k + 1])
            owner.setdefault(prefix, i)
            prefix_tree[i][k] = owner[prefix]
            if prefix not in slot_of_prefix:
                slot_of_prefix[prefix] = len(slot_of_prefix)
                tokens.append(beams[i][k])
                depth.append(k)
            unpacker[i][k] = slot_of_prefix[prefix]
    n = min(len(tokens), capacity)
    ancestors = []
    for c in range(n):
        prefix = next(p for p, s in slot_of_prefix.items() if s == c)
        ancestors.append({slot_of_prefix[prefix[: j + 1]] for j in range(len(prefix))})
    return prefix_tree, tokens[:n], depth[:n], unpacker, ancestors
