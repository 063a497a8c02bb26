"""The verifier as mlx-lm builds it: any text model mlx-lm implements, trees included.

:class:`LmModel` wraps the model object of ``mlx_lm.models.<family>`` and gives it the
engine's forward, ``(tokens, positions, mask, cache, write_idx, fresh)``, through the
hooks mlx-lm's own code already calls; no family's forward is copied
(docs/design/any-model.md):

* **K/V and masks.** Each attention layer gets a :class:`SlotCache`, an object of mlx-lm's
  cache protocol (``offset``, ``update_and_fetch``, ``make_mask``, ``state``) over our
  preallocated, slot-addressed storage: ``update_and_fetch`` writes the call's K/V at its
  slots (``write_idx``) and returns the buffers up to the attention window, and
  ``make_mask(N, window_size=w)`` answers with the engine's mask (a tree's ancestor mask
  over the cache), narrowed to the layer's sliding window when it asks for one.
* **Positions.** Every rope module of the model gets each token's own position (``len +
  depth`` in a tree): mx.fast.rope takes one offset per batch row, so a call's tokens are
  moved into the batch axis with offsets = their positions. On the CPU backend, where that
  kernel is slow, each distinct rope gives one cos/sin table per forward (the same kernel
  run once on a unit vector) and the layers rotate by it. Every ``rope_utils`` variant keeps
  its own frequencies either way.
* **Hidden states.** The module that holds the layers (``model.model`` for most families)
  is tapped: its output is the hidden state the engine keeps and the drafter reads; the
  outer model's own head turns a hidden state into logits (its tie, soft cap and scaling
  included). A drafter's feature layers are taps on those layers' inputs.

  A family that computes positions itself is reached too: a learned position embedding
  is tapped, and ``mx.fast.rope`` called with the cache's offset rotates per token.
* **Recurrent layers** keep a state per row (``StateCache``); over a tree each runs the
  tree's root-to-leaf paths as batch rows (``lm_cache.path_layer``), and the commit takes
  the state along the accepted path (``StateCommit``).
* **What a step may verify** is checked at load (``check_steps``): a tree, a chain, or
  one token, whatever a family's code does.

Taps change a module's class to a subclass with another ``__call__`` (``lm_taps.py``); the
parameter tree (mlx-lm's own: its children are this module's), weight names and every call
outside the engine's forward (mlx-lm's own ``generate`` in ``bench --mlx-lm``) are unchanged.

Shapes: B batch rows, T new tokens, S cache slots, A attended slots (A <= S), H hidden.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..core.tree import arange, cache_mask, chain_mask
from .entries import Slots, State
from .lm_cache import LmCall, ProbeCache, ProbeState, SlotCache, StateCache, StateCommit
from .lm_parts import embedding_of, head_layer, layers_owner
from .lm_rope import is_rope, rope_group, rope_layout, rope_tap
from .lm_taps import Exited, fast_rope_at, hidden_tap, layer_tap, patched, position_tap
from .protocol import Verifier

POSITION_EMBEDDINGS = ("wpe", "position_embeddings", "embed_positions")


class LmArgs:
    """The sizes the engine reads of any model (``model.args``: memory estimates, layer
    counts, the context), from its config.json (or its ``text_config``) and the probe; the
    attention settings an early-exit adapter copies (eps, rope) from the config."""

    def __init__(self, config: dict, hidden: int, vocab: int, layers: int, caches: list):
        text = {**(config.get("text_config") or {}), **config}
        self.rms_norm_eps = float(text.get("rms_norm_eps") or text.get("norm_eps") or 1e-6)
        theta = text.get("rope_theta") or 10000.0  # a list: one per layer (step3p5)
        self.rope_theta = float(theta[0] if isinstance(theta, list) else theta)
        self.rope_traditional = bool(text.get("rope_traditional", False))
        self.rope_scaling = text.get("rope_scaling")
        self.tie_word_embeddings = False  # whether the head is the embedding: LmModel sets it
        self.model_type = config.get("model_type")
        self.hidden_size = hidden
        self.vocab_size = vocab
        self.num_hidden_layers = layers
        self.max_position_embeddings = text.get("max_position_embeddings")
        kv_heads = max((n for n, _, _ in caches), default=1)
        self.num_key_value_heads = kv_heads
        self.head_dim = max((max(dk, dv) for _, dk, dv in caches), default=1)
        self.num_attention_heads = _positive(text.get("num_attention_heads"), kv_heads)
        self.intermediate_size = _positive(text.get("intermediate_size"), 4 * hidden)


def _positive(value, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


# mlx-lm's caches of keys and values (full or sliding: the window comes from ``make_mask``).
ATTENTION_CACHES = ("KVCache", "RotatingKVCache", "QuantizedKVCache", "ConcatenateKVCache")


class LmModel(Verifier):
    """Any mlx-lm text model as the engine's verifier.

    ``lm``: the model object of ``mlx_lm.models.<family>`` (weights loaded);
    ``config``: its config.json dict.
    """

    # a recurrent commit computes apart from the verify it follows (``lm_checks``)
    commit_apart = False

    def __init__(self, lm: nn.Module, config: dict):
        super().__init__()
        # ``lm`` is not a child: its children are this module's own, so the parameter tree
        # (names, dtype casts, freezing, saving) is mlx-lm's, the checkpoint's names.
        object.__setattr__(self, "lm", lm)
        self._adopt_children()
        self._resolve()
        self.config = config
        self.model_type = config.get("model_type")
        self.group = None
        self.shards = 1
        self.split_ids: tuple[int, ...] = ()
        self.feature_layers: tuple[int, ...] = ()
        object.__setattr__(self, "_state", _Owner())
        self._install_taps()
        kv, states, hidden, vocab = self._probe()
        # The engine's cache order: attention caches first (slot 0 always has slots; a
        # model without attention gets one empty cache for it), then recurrent states.
        order = list(kv) or [None]
        object.__setattr__(self, "_order", order + list(states))
        object.__setattr__(self, "_kv_shapes", [kv.get(i, (1, 1, 1)) for i in order])
        object.__setattr__(self, "_layouts", [states[i] for i in states])
        self._hidden_size = hidden
        shapes = list(self._kv_shapes)
        self.args = LmArgs(config, hidden, vocab, len(self._layers), shapes)
        self.args.tie_word_embeddings = self._head is self._embedding
        self._plain_head = self._reads_plain_head()
        # what a step may verify (``check_steps``): a tree (a recurrent layer runs its
        # paths as rows), one chain, or one token; ``narrowing`` says why when not a tree
        self.verifies = "tree"
        self.narrowing = None

    def _adopt_children(self) -> None:
        for name, child in self.lm.items():
            self[name] = child

    def _resolve(self) -> None:
        """Find the modules the engine reads (plain attributes, not children): the layers'
        owner, the layers, the input embedding and the output layer."""
        owner, layers = layers_owner(self.lm)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_layers", layers)
        object.__setattr__(self, "_embedding", embedding_of(owner, self.lm))
        object.__setattr__(self, "_head", head_layer(self.lm, self._embedding))

    @property
    def state(self):
        """mlx-lm's model's own tree, what its forward reads: ``mx.compile`` swaps the
        compiled step's weight inputs in place in it (an array a family keeps at the top,
        talkie's ``lm_head``, is in this module's dict too, which the forward never reads)."""
        return self.lm.state

    def _of_lm(self, tree: dict) -> dict:
        """The entries of a module or parameter tree that are mlx-lm's (not this module's
        own settings: ``config``, ``feature_layers``, ...)."""
        return {k: v for k, v in tree.items() if k in self.lm}

    def update_modules(self, modules: dict, *args, **kwargs):
        """Replace modules in mlx-lm's model (``nn.quantize``, LoRA), whose forward runs."""
        self.lm.update_modules(self._of_lm(modules), *args, **kwargs)
        self._adopt_children()
        self._resolve()
        return self

    def update(self, parameters: dict, *args, **kwargs):
        """Set parameters of mlx-lm's model (``load_weights`` too)."""
        self.lm.update(self._of_lm(parameters), *args, **kwargs)
        self._adopt_children()
        return self

    def check_commit(self) -> None:
        """ValueError unless every recurrent layer stops at mlx-lm's right-padding
        ``lengths``: the state after 3 tokens of which the first counts must equal the
        state after that token alone (a family that ignores ``lengths`` would commit a
        rejected draft's state, and pad a batched prefill into a row's state)."""
        if not self.recurrent:
            return
        cache = self.make_cache(1, 8)
        tokens = mx.array([[1, 2, 3]], dtype=mx.int32) % self.vocab_size
        start = mx.zeros((1,), mx.int32)
        pos = arange(3)[None]
        mask = cache_mask(start, chain_mask(3), 8)
        _, padded = self(tokens, pos, mask, cache, pos, counts=mx.array([1]))
        one = cache_mask(start, chain_mask(1), 8)
        _, alone = self(tokens[:, :1], pos[:, :1], one, cache, pos[:, :1])
        n_kv = len(self._kv_shapes)
        for a, b in zip(padded[n_kv:], alone[n_kv:]):
            if not bool(mx.allclose(a.flat, b.flat, atol=1e-5, rtol=1e-4)):
                raise ValueError(
                    f"model_type {self.model_type!r}: its recurrent layers take in tokens "
                    "past mlx-lm's right-padding lengths, so a step could not keep the "
                    "accepted tokens' state alone; this family cannot be sped up yet"
                )

    def check_steps(self) -> None:
        """Find at load what a step may verify (``verifies``), by what it relies on: a small
        tree's node logits, verified in one call, against plain decoding's (one token a
        call), then a chain's the same way. A family whose code takes positions from
        somewhere the taps do not reach gives other logits there: it verifies chains if its
        chains pass, else one token a step (plain decoding), and ``narrowing`` says why.
        A forward that fails under the engine's caches: ValueError naming the family."""
        try:
            self._check_steps()
        except ValueError:
            raise
        except Exception as e:  # a family's forward that cannot run on the engine's caches
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"model_type {self.model_type!r} does not run on the engine's slot caches "
                f"({type(e).__name__}: {reason}); this family cannot be loaded yet"
            ) from None

    def _check_steps(self) -> None:
        S, V = 16, self.vocab_size
        prompt = [(7 * i + 3) % V for i in range(5)]
        a, b, c, d = ((11 * i + 5) % V for i in range(4))
        # the tree: a, its children b and c, then d under b
        T = len(prompt)
        idx = arange(T)[None]
        _, cache = self(
            mx.array([prompt]), idx, cache_mask(mx.zeros((1,), mx.int32), chain_mask(T), S),
            self.make_cache(1, S), idx,
        )  # fmt: skip
        after_a = self._stepped(cache, T, [a], S)  # plain decoding, one token a call
        after_ab = self._stepped(after_a[1], T + 1, [b], S)
        plain = [after_a[0], after_ab[0], self._stepped(after_a[1], T + 1, [c], S)[0]]
        plain.append(self._stepped(after_ab[1], T + 2, [d], S)[0])
        parents = [[0], [0, 1], [0, 2], [0, 1, 3]]
        ancestors = mx.array([[[j in p for j in range(4)] for p in parents]])
        paths = mx.array([[[0, 1, 3], [0, 2, 4]]])  # root-to-leaf slots (4: past the end)
        chain = self._verified(cache, T, [a, b, d], [0, 1, 2], chain_mask(3), S)
        try:
            tree = self._verified(cache, T, [a, b, c, d], [0, 1, 1, 2], ancestors, S, paths)
        except Exception as e:  # a recurrent layer that cannot run a tree's paths as rows
            if not self.recurrent:
                raise
            tree, failed = None, f"{type(e).__name__}: {str(e).strip()[:80]}"
        tol = (1e-4 if self.dtype == mx.float32 else 3e-2) * max(
            1.0, max(float(mx.abs(p).max()) for p in plain)
        )

        def off(got, want) -> float:
            return max(float(mx.abs(g - w).max()) for g, w in zip(got, want))

        chain_off = off(chain, [plain[i] for i in (0, 1, 3)])
        tree_off = off(tree, plain) if tree is not None else float("inf")
        if chain_off > tol:
            self.verifies = "token"
            self.narrowing = (
                f"{self.model_type}: a chain verified in one call differs from plain decoding "
                f"(by {chain_off:.3g} in a logit at load), so every step verifies one token"
            )
        elif tree is None:
            self.verifies = "chain"
            self.narrowing = (
                f"{self.model_type}'s recurrent layers cannot run a tree's paths as batch "
                f"rows ({failed} at load), so each step verifies one chain"
            )
        elif tree_off > tol and self.recurrent:
            self.verifies = "chain"
            self.narrowing = (
                f"{self.model_type}: a tree over its recurrent layers (each path a batch row) "
                f"differs from plain decoding by {tree_off:.3g} in a logit at load, so each "
                "step verifies one chain"
            )
        elif tree_off > tol:
            self.verifies = "chain"
            self.narrowing = (
                f"{self.model_type} takes token positions from its own code, which a tree's "
                f"branches do not reach (a tree's logits differ from plain decoding by "
                f"{tree_off:.3g} at load), so each step verifies one chain"
            )

    def _stepped(self, cache: tuple, length: int, path: list[int], S: int):
        """Plain decoding's logits after ``path`` (one token a call from ``length``; a cache
        of ``S`` slots): ((V,), the cache after it)."""
        for j, token in enumerate(path):
            pos = mx.array([[length + j]])
            mask = cache_mask(mx.array([length + j]), chain_mask(1), S)
            h, cache = self(mx.array([[token]]), pos, mask, cache, pos)
        return self.logits(h[0, -1]), cache

    def _verified(self, cache, length, tokens, depths, ancestors, S, paths=None) -> list:
        """Each node's logits when ``tokens`` (at ``length + depth``, slots in order, attending
        to ``ancestors`` (1, n, n) bool; a tree's ``paths`` (1, P, Lp)) are verified in one
        call: (V,) each."""
        n = len(tokens)
        positions = mx.array([[length + d for d in depths]])
        slots = length + arange(n)[None]
        mask = cache_mask(mx.array([length]), ancestors, S)
        counts = mx.array([n]) if self.recurrent else None
        h, _ = self(mx.array([tokens]), positions, mask, cache, slots, counts=counts, paths=paths)
        out = self.logits(h[0])
        return [out[i] for i in range(n)]

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state: a verify then commits it by running
        the layer again over the accepted path, and runs a tree's paths as batch rows."""
        return bool(self._layouts)

    # -- taps ---------------------------------------------------------------------------

    def _install_taps(self) -> None:
        state = self._state
        object.__setattr__(self._owner, "_rd_owner", state)
        patched(self._owner, hidden_tap, "hidden")
        for i, layer in enumerate(self._layers):
            object.__setattr__(layer, "_rd_owner", state)
            object.__setattr__(layer, "_rd_index", i)
            patched(layer, layer_tap, "layer")
        for name in POSITION_EMBEDDINGS:
            table = self._owner.get(name)
            if isinstance(table, nn.Embedding) and table is not self._embedding:
                object.__setattr__(table, "_rd_owner", state)
                patched(table, position_tap, "positions")
        groups: list[tuple[type, Any]] = []  # (class, probe) per rope group
        for _, module in self.lm.named_modules():
            if not is_rope(module) or hasattr(module, "_rd_owner"):
                continue
            object.__setattr__(module, "_rd_owner", state)
            object.__setattr__(module, "_rd_layout", rope_layout(module))
            object.__setattr__(module, "_rd_group", rope_group(module, groups))
            patched(module, rope_tap, "rope")

    def _probe(self):
        """One lazy one-token forward (nothing is evaluated): each attention cache's
        (n_kv, key dim, value dim) and each recurrent cache's layout, by mlx-lm index,
        the hidden size and the vocabulary. A cache kind we cannot hold: ValueError."""
        kinds = self._make_lm_cache()
        shapes: dict[int, tuple] = {}
        caches: list = []
        for i, kind in enumerate(kinds):
            name = type(kind).__name__
            if kind is None or name in ATTENTION_CACHES:
                caches.append(ProbeCache(shapes, i))
            elif isinstance(getattr(kind, "cache", None), list):  # ArraysCache, MambaCache
                caches.append(ProbeState(len(kind.cache)))
            else:
                raise ValueError(
                    f"model_type {self.model_type!r} keeps a {name} cache, which this "
                    "version cannot hold yet"
                )
        tokens = mx.zeros((1, 1), dtype=mx.int32)
        self._state.probing = True
        try:
            logits = self.lm(tokens, cache=caches)
        finally:
            self._state.probing = False
        hidden, self._state.last_hidden = self._state.last_hidden, None
        if hidden is logits:  # gemma3n: the layers' module applies the head itself
            raise ValueError(
                f"model_type {self.model_type!r}: the module holding its layers returns "
                "logits, not hidden states (it applies the head itself), so there is no "
                "hidden state for the engine to keep; this family cannot be loaded yet"
            )
        states = {i: c.layout() for i, c in enumerate(caches) if isinstance(c, ProbeState)}
        kv = {i: shapes[i] for i, c in enumerate(caches) if i in shapes}
        unused = [i for i, c in enumerate(caches) if isinstance(c, ProbeCache) and i not in kv]
        if unused:  # a cache a layer shares rather than writes: never read from ours
            kv.update({i: (1, 1, 1) for i in unused})
        object.__setattr__(self, "_n_lm", len(caches))
        return kv, states, hidden.shape[-1], logits.shape[-1]

    def _make_lm_cache(self) -> list:
        if hasattr(self.lm, "make_cache"):
            return self.lm.make_cache()
        return [None] * len(self._layers)

    def _reads_plain_head(self) -> bool:
        """Whether the model's logits are its head layer's rows times the hidden state, no
        more (no soft cap, scale or bias): checked on a probe at load, over a sample of ids,
        so ``head_rows`` may stand in for the head (a shortlist's rows)."""
        H, V = self.hidden_size, self.vocab_size
        ids = sorted({int(i) for i in range(0, V, max(1, V // 64))} | {V - 1})
        h = mx.random.normal((2, H), key=mx.random.key(7)).astype(self.dtype)
        want = mx.take(self.logits(h), mx.array(ids, dtype=mx.int32), axis=-1)
        got = (h @ self._rows(ids).T).astype(mx.float32)
        scale = mx.max(mx.abs(want)) + 1e-6
        return bool(mx.all(mx.abs(want - got) <= 1e-3 * scale + 1e-4))

    def _rows(self, ids) -> mx.array:
        """The head layer's rows at ``ids`` (None: all), (K or V, H), dequantized."""
        layer = self._head
        index = None if ids is None else mx.array(ids, dtype=mx.int32)
        weight = layer.weight if index is None else layer.weight[index]
        if "scales" not in layer:
            return weight
        scales = layer.scales if index is None else layer.scales[index]
        biases = layer.get("biases")
        if biases is not None and index is not None:
            biases = biases[index]
        mode = getattr(layer, "mode", "affine")
        return mx.dequantize(weight, scales, biases, layer.group_size, layer.bits, mode)

    def head_rows(self, ids=None) -> mx.array | None:
        """The output layer's rows at token ``ids`` (a list or an array; None: every id),
        (K or V, H), dequantized when quantized: ``hidden @ rows.T`` are those tokens'
        logits. None when the model's logits are more than that (a soft cap, a scale):
        then only ``head_logits`` reads them."""
        return self._rows(ids) if self._plain_head else None

    # -- the engine's interface ---------------------------------------------------------

    @property
    def layers(self) -> list:
        """The model's blocks, in order (mlx-lm's own modules)."""
        return self._layers

    @property
    def model(self) -> nn.Module:
        """The module that holds the layers (mlx-lm's ``model.model`` for most families)."""
        return self._owner

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def dtype(self):
        """The float dtype the model computes in (its embedding's, or its scales')."""
        scales = self._embedding.get("scales")
        return (scales if scales is not None else self._embedding.weight).dtype

    def embed(self, tokens: mx.array) -> mx.array:
        """The input embedding lookup, (...) -> (..., H), unscaled."""
        return self._embedding(tokens)

    def __call__(
        self, tokens, positions, mask, cache, write_idx, fresh=None, counts=None, paths=None
    ):
        """One forward over T new tokens per row against the cache (``Verifier``).

        tokens, positions, write_idx: (B, T); mask: (B, 1, T, A) bool; cache: the entries in
        the engine's order (``_order``; ``entries.py``). ``counts`` (B,): the tokens per row
        a recurrent layer takes in (a right-padded prefill); None: all T. ``paths`` (B or 1,
        P, Lp): a tree's root-to-leaf paths, each position's slot (>= T past a path's end;
        ``tree.unpacker``), which the recurrent layers run as batch rows (each node's state
        after its own ancestors; the attention layers read the tree's mask); ignored by a
        model without recurrent layers, and with one path. ``fresh``: a list
        that receives, per entry, what its commit needs (``Slots.commit``/``State.commit``):
        an attention cache's new (K, V), (B, T, n_kv, D) each, or a recurrent layer's
        ``StateCommit``.
        Returns (hidden (B, T, state_width), the cache after the call).
        """
        if not self.recurrent or paths is None or paths.shape[1] < 2:
            paths = None  # one path: the tokens in order, as a chain runs
        call = LmCall(self, positions, mask, cache, write_idx, counts, paths)
        caches = self._caches(call)
        self._run(tokens, call, caches)  # the logits are never read: lazily dead
        n_kv = len(self._kv_shapes)
        for e, i in enumerate(self._order[n_kv:], start=n_kv):
            call.cache[e] = State(caches[i].flat())
        if fresh is not None:
            for e, i in enumerate(self._order):
                if e < n_kv:
                    fresh.append(call.fresh.get(e))
                else:
                    layout = self._layouts[e - n_kv]
                    fresh.append(StateCommit(call, e, layout, caches[i].start))
        hidden = call.hidden
        if self.feature_layers:
            hidden = mx.concatenate(
                [hidden, *(call.features[i] for i in self.feature_layers)], axis=-1
            )
        return hidden, tuple(call.cache)

    def _caches(self, call: LmCall) -> list:
        """mlx-lm's cache list for one call: a ``SlotCache`` per attention cache, a
        ``StateCache`` per recurrent layer (a row starting at position 0 from zero state)."""
        caches: list = [None] * self._n_lm
        n_kv = len(self._kv_shapes)
        for e, i in enumerate(self._order):
            if e < n_kv:
                if i is not None:
                    caches[i] = SlotCache(call, e)
                continue
            start = call.cache[e].flat
            if start.shape[0] > 0:
                fresh_row = (call.positions[:, 0] == 0)[:, None, None]
                start = mx.where(fresh_row, mx.zeros_like(start), start)
            caches[i] = StateCache(call, e, self._layouts[e - n_kv], start)
        return caches

    def _run(self, tokens: mx.array, call: LmCall, caches: list) -> None:
        """mlx-lm's forward with the taps reading ``call`` (an early exit ends it)."""
        state = self._state
        state.call = call
        try:
            with fast_rope_at(call):
                self.lm(tokens, cache=caches)
        except Exited:
            pass
        finally:
            state.call = None

    def run_to(self, tokens, positions, mask, cache, write_idx, stop: int):
        """The model's first ``stop`` layers only (an early exit): the residual stream entering
        layer ``stop``, (B, T, H), with the cache those layers write (the arguments as in
        ``__call__``; later layers never run, their entries come back as given). Attention
        models only (``check_early_exit``)."""
        call = LmCall(self, positions, mask, cache, write_idx)
        call.stop = stop
        self._run(tokens, call, self._caches(call))
        if call.exit is None:
            raise ValueError(f"model_type {self.model_type!r} never reached layer {stop}")
        return call.exit, tuple(call.cache)

    def check_early_exit(self) -> None:
        """ValueError unless the model's first layers can run alone (``run_to``): no
        recurrent layer, whose state an exit would leave behind. The exit layer's range is
        the adapter's check (``early_exit.check_args``)."""
        if self.recurrent:
            raise ValueError(
                f"model_type {self.model_type!r} has recurrent layers; an early-exit adapter "
                "runs on attention-only models"
            )

    def logits(self, hidden: mx.array) -> mx.array:
        """(..., H) -> (..., V) float32 logits from the model's own head."""
        H = self.hidden_size
        if hidden.shape[-1] != H:
            hidden = hidden[..., :H]
        lead = hidden.shape[:-1]
        flat = hidden.reshape(1, -1, H)
        state = self._state
        state.substitute = flat
        try:
            out = self.lm(mx.zeros(flat.shape[:2], dtype=mx.int32))
        finally:
            state.substitute = None
        return out.reshape(*lead, -1).astype(mx.float32)

    def head_logits(self, hidden: mx.array, ids) -> mx.array:
        """(..., H) -> (..., K) float32 logits of token ``ids`` alone: those rows of a plain
        head (``head_rows``), else the model's own head (any scaling or cap a family
        applies), then those columns."""
        rows = self.head_rows(ids)
        if rows is None:
            return mx.take(self.logits(hidden), mx.array(ids, dtype=mx.int32), axis=-1)
        return (hidden[..., : self.hidden_size] @ rows.T).astype(mx.float32)

    def make_cache(self, batch: int, slots: int, dtype=None) -> tuple:
        """A zeroed cache in the engine's order (``entries.py``): ``Slots`` of (batch, n_kv,
        slots, D) keys and values per attention cache (a model without attention has one
        of (batch, 1, slots, 1): the cache's slot count), then a (batch, 1, F) float32
        ``State`` per recurrent layer."""
        dtype = dtype or self.dtype
        cache = [
            Slots(mx.zeros((batch, n, slots, dk), dtype), mx.zeros((batch, n, slots, dv), dtype))
            for n, dk, dv in self._kv_shapes
        ]
        for layout in self._layouts:
            size = sum(entry[3] for entry in layout if entry is not None)
            cache.append(State(mx.zeros((batch, 1, size), mx.float32)))
        return tuple(cache)


class _Owner:
    """What the taps read: the current call, a substituted hidden state, the probe."""

    def __init__(self):
        self.call: LmCall | None = None
        self.substitute: mx.array | None = None
        self.last_hidden = None
        self.probing = False


def from_config(config: dict, dtype=None) -> LmModel:
    """A verifier built by mlx-lm's own class for ``config`` (a config.json dict), with the
    class's initial weights, in ``dtype`` when given (tests, benchmarks, a converter's shape
    check; a folder loads with ``loading.load_model``)."""
    from mlx_lm.utils import _get_classes

    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    if dtype is not None:
        lm.set_dtype(dtype)
    mx.eval(lm.parameters())
    return LmModel(lm, config)
