"""Tiny random Llama models and drafters for tests, and the committed fixture paths."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from redrafter_mlx.engine.drafting.drafter import Drafter, DrafterArgs
from redrafter_mlx.engine.verifier.config import completed
from redrafter_mlx.engine.verifier.lm_model import LmModel, from_config
from tests.support.paths import FIXTURES

VICUNA_TOKENIZER = FIXTURES / "vicuna-tokenizer"
SHAREGPT_SAMPLE = FIXTURES / "sharegpt_tiny.json"


def tiny_config(vocab=32, hidden=32, layers=2, heads=4, kv_heads=2, **kw) -> dict:
    """The config.json of a tiny Llama (or, with ``model_type``, another of the families whose
    absent keys take transformers' defaults, ``config.for_mlx_lm``)."""
    cfg = dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cfg.update(kw)
    return completed(cfg)


def _randomize(module: nn.Module, seed: int, scale: float) -> None:
    key = mx.random.key(seed)
    params = tree_flatten(module.parameters())
    keys = mx.random.split(key, len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if "norm" in name:
            new.append((name, 1.0 + 0.1 * mx.random.normal(p.shape, key=k)))
        else:
            new.append((name, scale * mx.random.normal(p.shape, key=k) / (p.shape[-1] ** 0.5)))
    module.load_weights(new)
    mx.eval(module.parameters())


def tiny_model(seed=0, scale=2.0, **kw) -> LmModel:
    """A random Llama (mlx-lm's class, the verifier) whose logits are peaked enough that
    drafts get accepted sometimes."""
    model = from_config(tiny_config(**kw))
    _randomize(model, seed, scale)
    return model


def tiny_drafter(
    model: LmModel, seed=1, layers=2, exit_dim=None, rnn=True, scale=2.0, feature_layers=None
) -> Drafter:
    H = model.hidden_size
    args = DrafterArgs(
        vocab_size=model.vocab_size,
        hidden_size=H,
        exit_dim=exit_dim or 2 * H,
        num_draft_layers=layers,
        rnn=rnn,
        feature_layers=feature_layers,
    )
    drafter = Drafter(args)
    _randomize(drafter, seed, scale)
    return drafter


def greedy_prefilled(model: LmModel, prompt: list[int], slots: int, sources=()):
    """One row's ``DecodeState`` after prefilling ``prompt`` into a fresh cache of ``slots``
    slots, its first token greedy; ``sources``: the stateful sources' prefilled states."""
    from redrafter_mlx.engine.decoding.decode import DecodeState, prefill_chunk

    cache = model.make_cache(1, slots)
    zero = mx.zeros((1,), mx.int32)
    toks = mx.array([prompt], mx.int32)
    hidden, lengths, cache = prefill_chunk(model, toks, zero + len(prompt), zero, cache, slots)
    first = mx.argmax(model.logits(hidden), axis=-1).astype(mx.int32)
    history = mx.array([prompt + [0] * (slots - len(prompt))], mx.int32)
    return DecodeState(first, hidden, lengths, cache, history, tuple(sources))


def step_added_peak(step, state, window: int) -> int:
    """The peak memory a compiled ``step`` adds over what is live (compiled and run once
    first, caches cleared): bytes."""
    import gc

    state, out = step(state, window)  # compile, and run once
    mx.eval(state, out)
    del out
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    state, out = step(state, window)  # the old state is held by the step's graph only
    mx.eval(state, out)
    return mx.get_peak_memory() - base


def near_bigram_model(seed=0, attn_scale=0.02, **kw) -> LmModel:
    """A random Llama whose attention output is scaled down: next token ~ f(current token).

    Attention still matters a little, so cache or mask bugs still change outputs sometimes,
    but an oracle drafter that knows f gets long runs accepted.
    """
    model = tiny_model(seed, **kw)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * attn_scale
    mx.eval(model.parameters())
    return model


class OracleDrafter:
    """A drafter double for ``beam_search``: predicts the model's attention-free next token.

    State is the embedding of the last beam token; logits replay the model's layers without
    attention, plus a fixed random perturbation of size ``noise`` so some drafts are wrong.
    """

    def __init__(self, model: LmModel, noise=0.5, seed=3):
        self.model = model
        self.args = DrafterArgs(
            vocab_size=model.vocab_size,
            hidden_size=model.hidden_size,
            exit_dim=2 * model.hidden_size,
        )
        self.noise = noise * mx.random.normal(
            (model.hidden_size, model.vocab_size), key=mx.random.key(seed)
        )

    def next_state(self, state, token_emb):
        return token_emb

    def __call__(self, hidden, state):
        x = state
        for layer in self.model.model.layers:
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.model.model.norm(x)
        return self.model.logits(h) + h @ self.noise


def save_model_dir(model: LmModel, path, tokenizer_dir=None) -> None:
    """Write an mlx-lm style model dir (config.json + model.safetensors [+ tokenizer])."""
    import json
    import shutil
    from pathlib import Path

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy(f, path / f.name)


def save_drafter_dir(drafter: Drafter, path) -> None:
    import json
    from pathlib import Path

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.args.to_config()))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(drafter.parameters())))


def run_decode(model, drafter, prompts, **kw):
    """All tokens per row and the final stats of ``engine.loop.generation.generate_steps``."""
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.generation import generate_steps

    width, length, capacity = (kw.pop(k, None) for k in ("beam_width", "beam_length", "capacity"))
    if (width, length, capacity) != (None, None, None):
        kw["shape"] = BeamShape(
            4 if width is None else width, 4 if length is None else length, capacity
        )
    out = [[] for _ in prompts]
    stats = None
    for ev in generate_steps(model, drafter, prompts, **kw):
        for r, t in enumerate(ev.tokens):
            out[r] += t
        stats = ev.stats.to_dict()
    return out, stats


def state_slot(batch, source_id: int) -> int:
    """The index in ``batch.state.sources`` (and ``batch.batch_state.behind``) of the
    stateful source with ``source_id`` the loop holds."""
    return [s.source_id for s in batch.batch_state.stateful].index(source_id)


def step_sources(shape, drafter=None, draft_model=None) -> list:
    """The draft sources a step of ``shape`` runs with this drafter and draft slot, sized and
    in held order (what the step builds: ``held.held_sources``, ``sources.sized_sources``)."""
    from redrafter_mlx.engine.drafting.held import held_sources
    from redrafter_mlx.engine.drafting.sources import sized_sources

    return sized_sources(held_sources(drafter, draft_model), shape)
