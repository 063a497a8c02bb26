"""Engine micro-benchmarks that need no trained weights.

``verify_cost``: how much one tree-verification forward over C packed tokens costs relative
to one autoregressive decode step, on a random Llama large enough to be memory-bound. With
a good drafter, speculation pays when tokens/step exceeds this ratio (plus drafting cost).
Random weights make acceptance meaningless, so this is the figure that stands on its own.
"""

from __future__ import annotations

import time

import mlx.core as mx

from redrafter_mlx.engine.base.platform import default_dtype
from redrafter_mlx.engine.core.sampling import RowSampler, SamplerConfig, draw
from redrafter_mlx.engine.core.tree import arange, cache_mask, chain_mask
from redrafter_mlx.engine.decoding.decode import DecodeState, prefill_chunk
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.verifier.lm_model import from_config
from redrafter_mlx.engine.verifier.protocol import Verifier


def random_llama(
    hidden: int, layers: int, vocab: int = 32000, dtype=None, seed: int = 0
) -> Verifier:
    """A Llama-shaped model (head_dim 128, MLP 2.6875x like LLaMA-7B) with random weights."""
    config = dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=int(hidden * 2.6875) // 64 * 64,
        num_attention_heads=max(1, hidden // 128),
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    dtype = dtype or default_dtype()
    model = from_config(config)
    model.lm.update(_random_weights(model.lm.parameters(), dtype))
    mx.eval(model.lm.parameters())
    return model


def _random_weights(tree, dtype):
    from mlx.utils import tree_map

    return tree_map(lambda p: (0.02 * mx.random.normal(p.shape)).astype(dtype), tree)


def _interleaved_ms(fns: dict, repeats: int) -> dict:
    """Median ms of each thunk, timed in interleaved rounds (noise hits all alike), plus the
    per-round times under ``"rounds"`` for paired ratios."""
    for fn in fns.values():  # warm-up (compiles)
        fn()
        fn()
    rounds = []
    for _ in range(repeats):
        times = {}
        for name, fn in fns.items():
            tic = time.perf_counter()
            fn()
            times[name] = 1e3 * (time.perf_counter() - tic)
        rounds.append(times)
    out = {name: _median([r[name] for r in rounds]) for name in fns}
    out["rounds"] = rounds
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _verify_fn(model: Verifier, capacity: int, window: int):
    """Compiled verify forward of ``capacity`` chain-masked tokens + target draws."""

    def verify(tokens, lengths, cache):
        idx = lengths[:, None] + arange(capacity)[None, :]
        mask = cache_mask(lengths, chain_mask(capacity), window)
        hidden, cache = model(tokens, idx, mask, cache, idx)
        greedy = RowSampler.from_config(SamplerConfig(), model.vocab_size, None, tokens.shape[0])
        return draw(model.logits(hidden), greedy), cache

    return mx.compile(verify)


def verify_cost(
    hidden: int = 2048,
    layers: int = 8,
    capacities=(4, 8, 16, 32),
    context: int = 512,
    repeats: int = 20,
    vocab: int = 32000,
) -> list[dict]:
    """Per capacity C: AR step ms, verify ms, and their ratio (same model, cache, context)."""
    model = random_llama(hidden, layers, vocab)
    from redrafter_mlx.engine.decoding.cache import bucket

    # The attention window the decode loop itself would use at this context (it rounds up
    # to whole SLOT_QUANTUM slots), not a power of two that would make every query attend to
    # up to twice the slots the loop does.
    window = bucket(context + max(capacities))
    prompt = mx.random.randint(0, vocab, (1, context)).astype(mx.int32)
    zeros = mx.zeros((1,), dtype=mx.int32)
    h, lengths, cache = prefill_chunk(
        model, prompt, zeros + context, zeros, model.make_cache(1, window), window
    )
    mx.eval(h, lengths, cache)
    # Carry the cache from call to call (so it is updated in place, as in the decode loop)
    # but reset the length, so every call sees the same context.
    state = {"ar": DecodeState(mx.array([1]), h, lengths, cache)}
    ar_step = uniform_step(model, (), None, SamplerConfig(), 1)  # the loop's own step

    def ar():
        nxt, out = ar_step(state.pop("ar"), window)
        mx.eval(out, nxt)
        state["ar"] = nxt._replace(lengths=lengths)

    def verify_thunk(C):
        fn = _verify_fn(model, C, window)
        tokens = mx.random.randint(0, vocab, (1, C)).astype(mx.int32)

        def verify():
            nxt = state.pop("ar")
            cache = nxt.cache
            nxt = nxt._replace(cache=None)
            out, cache = fn(tokens, lengths, cache)  # only the graph holds the old cache now:
            mx.eval(out, cache)  # the K/V writes happen in place
            state["ar"] = nxt._replace(cache=cache)

        return verify

    fns = {"ar": ar, **{C: verify_thunk(C) for C in capacities}}
    timed = _interleaved_ms(fns, repeats)
    rows = []
    for C in capacities:
        paired = _median([r[C] / r["ar"] for r in timed["rounds"]])
        rows.append(
            dict(
                capacity=C,
                ar_ms=timed["ar"],
                verify_ms=timed[C],
                ratio=timed[C] / timed["ar"],
                paired_ratio=paired,
            )
        )
    return rows


def main() -> None:  # python -m redrafter_mlx.measure.verify_cost
    import argparse

    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = verify_cost(args.hidden, args.layers, context=args.context, repeats=args.repeats)
    table = Table(
        title=f"verify cost, hidden {args.hidden}, {args.layers} layers, "
        f"{mx.default_device()}, context {args.context}"
    )
    for col in ("C", "AR step ms", "verify ms", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["capacity"]), f"{r['ar_ms']:.1f}", f"{r['verify_ms']:.1f}", f"{r['ratio']:.2f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
