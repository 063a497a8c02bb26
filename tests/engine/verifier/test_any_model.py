"""Any model mlx-lm builds is the verifier (``engine/verifier/lm_model.py``), trees and recurrent
layers included: tiny random models of 31 families written by mlx-lm's own classes.

* prefill and one-token steps give mlx-lm's own logits (its forward with its own caches);
* every node of a verified tree gives the logits of its own sequence (attention families);
* greedy speculation (lookup chains, a drafter's beams and trees, the model as its own draft
  model, several rows batched) gives plain decoding's tokens, and rows batched give their
  solo tokens; recurrent models verify trees too (their recurrent layers run the tree's
  paths as batch rows: ``test_recurrent_trees.py``), without a note;
* seeded sampling is exact (chi-square, with a power check) on a hybrid and an MoE model;
* folders load through mlx-lm (a Llama with sliding layers decodes mlx-lm's tokens); a
  family mlx-lm lacks, a config it refuses, and recurrent layers that ignore its
  right-padding lengths get one clear line.
"""

from __future__ import annotations

import functools
import json
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.engine.loop.loading import LoadError, load_model
from redrafter_mlx.engine.verifier.lm_model import LmModel
from tests.support.drafters import ReplayDrafter
from tests.support.mlx_lm_families import ATTENTION, IGNORES_LENGTHS, RECURRENT
from tests.support.models import run_decode
from tests.support.sampling import chi_square_pvalue, lm_joint

FAMILIES = {**ATTENTION, **RECURRENT}
PROMPT = [1, 7, 3, 9, 4, 2, 8, 5, 6, 3]
STEPS = [4, 9, 2]
PROMPTS = [[1, 5, 9, 2, 7, 5, 9, 2, 7, 5], [3, 4, 4, 3, 8, 3, 4, 4, 3], [2]]
TOKENS = 24


def mlx_lm_class(config: dict):
    """mlx-lm's model for ``config``, its default (random) initialisation, float32."""
    cls, args = _get_classes(config)
    mx.random.seed(0)
    lm = cls(args.from_dict(config))
    lm.set_dtype(mx.float32)
    mx.eval(lm.parameters())
    return lm


@functools.cache
def family(name: str) -> LmModel:
    """The verifier over mlx-lm's model of ``name`` (shared by the tests of a family)."""
    return LmModel(mlx_lm_class(FAMILIES[name]), FAMILIES[name])


def mlx_lm_logits(lm) -> list[mx.array]:
    """mlx-lm's own forward: the prompt's last logits, then each of ``STEPS``'s."""
    cache = make_prompt_cache(lm)
    out = [lm(mx.array([PROMPT]), cache=cache)[0, -1]]
    for t in STEPS:
        out.append(lm(mx.array([[t]]), cache=cache)[0, -1])
    return out


def engine_logits(model: LmModel) -> list[mx.array]:
    """The engine's calls: the prompt at once, then one token a call, against our cache."""
    S = 64
    cache = model.make_cache(1, S)
    T = len(PROMPT)
    idx = mx.arange(T)[None]
    mask = cache_mask(mx.array([0]), chain_mask(T), S)
    h, cache = model(mx.array([PROMPT]), idx, mask, cache, idx)
    out = [model.logits(h[:, -1])[0]]
    for p, t in enumerate(STEPS, start=T):
        pos = mx.array([[p]])
        mask = cache_mask(mx.array([p]), chain_mask(1), S)
        h, cache = model(mx.array([[t]]), pos, mask, cache, pos)
        out.append(model.logits(h[:, 0])[0])
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_and_steps_give_mlx_lm_logits(name, fused, monkeypatch):
    from redrafter_mlx.engine.verifier import slots as model_module

    monkeypatch.setattr(model_module, "FUSED_KERNELS", fused)  # rope tables or the kernel
    model = family(name)
    for i, (got, want) in enumerate(zip(engine_logits(model), mlx_lm_logits(model.lm))):
        diff = mx.abs(got - want).max().item()
        scale = max(1.0, mx.abs(want).max().item())  # float32 rounding grows with it
        assert diff <= 1e-5 * scale, f"{name} position {i}: {diff} (logits up to {scale:.1f})"


# A tree after the prompt: the root (depth 0), two branches of two.
NODES = [STEPS[0], 11, 12, 13, 14]
PARENT = [-1, 0, 1, 0, 3]
DEPTH = [0, 1, 2, 1, 2]


def path_of(i: int) -> list[int]:
    path = []
    while i >= 0:
        path.insert(0, NODES[i])
        i = PARENT[i]
    return path


@pytest.mark.parametrize("name", list(ATTENTION))
def test_each_tree_node_gives_its_own_sequence_logits(name):
    model = family(name)
    S, T = 64, len(PROMPT)
    cache = model.make_cache(1, S)
    idx = mx.arange(T)[None]
    mask = cache_mask(mx.array([0]), chain_mask(T), S)
    _, cache = model(mx.array([PROMPT]), idx, mask, cache, idx)
    ancestors = [[j in _ancestors(i) for j in range(len(NODES))] for i in range(len(NODES))]
    mask = cache_mask(mx.array([T]), mx.array(ancestors)[None], S)
    positions = mx.array([[T + d for d in DEPTH]])
    slots = mx.array([[T + i for i in range(len(NODES))]])
    hidden, _ = model(mx.array([NODES]), positions, mask, cache, slots)
    logits = model.logits(hidden)[0]
    for i in range(len(NODES)):
        want = model.lm(mx.array([PROMPT + path_of(i)]))[0, -1]
        diff = mx.abs(logits[i] - want).max().item()
        scale = max(1.0, mx.abs(want).max().item())  # float32 rounding grows with it
        assert diff <= 1e-5 * scale, f"{name} node {i}: {diff} (logits up to {scale:.1f})"


def _ancestors(i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = PARENT[i]
    return out


@functools.cache
def plain(name: str) -> list[list[int]]:
    """Plain decoding of ``PROMPTS``, batched."""
    out, _ = run_decode(
        family(name), None, PROMPTS, max_tokens=TOKENS, shape=BeamShape.autoregressive()
    )
    return out


SHAPES = ["K1xL4", "W1xL4", "W2xL3", "W1xL5+K1xL8", "W4xL4+K2xL4"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_speculation_gives_plain_decoding_tokens(name):
    model = family(name)
    want = plain(name)
    solo = [
        run_decode(model, None, [p], max_tokens=TOKENS, shape=BeamShape.autoregressive())[0][0]
        for p in PROMPTS
    ]
    assert want == solo, f"{name}: batched rows differ from their solo decoding"
    drafter = ReplayDrafter(model, [p + a for p, a in zip(PROMPTS, want)])
    accepted = 0
    for label in SHAPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a recurrent model's chain note
            got, stats = run_decode(
                model, drafter, PROMPTS, max_tokens=TOKENS, shape=BeamShape.parse(label)
            )
        assert got == want, f"{name} {label}"
        accepted = max(accepted, stats["tokens_per_step"])
    assert accepted > 1.5  # drafts were accepted, in part: commits at several lengths
    if not model.recurrent:
        got, stats = run_decode(
            model, None, PROMPTS, max_tokens=TOKENS, shape=BeamShape.parse("D1xL4"),
            draft_model=model,
        )  # fmt: skip
        assert got == want, f"{name}: the model as its own draft model"
        assert stats["tokens_per_step"] > 3.5


def test_a_recurrent_model_runs_a_tree_shape_as_a_tree_without_a_note():
    model = LmModel(mlx_lm_class(RECURRENT["qwen3_5"]), RECURRENT["qwen3_5"])
    assert model.recurrent and model.verifies == "tree"
    drafter = ReplayDrafter(model, PROMPTS)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_decode(model, drafter, PROMPTS[:1], max_tokens=4, shape=BeamShape.parse("W2xL3"))
    assert not [w for w in said if "runs as" in str(w.message)]
    # the nearest chain, what a model that fails the tree check at load runs
    assert BeamShape.parse("W4xL5+K2xL8").as_chain() == BeamShape.parse("W1xL5+K1xL8 C5")
    assert BeamShape.parse("K1xL8").verifies_chain


def test_recurrent_layers_that_ignore_the_padding_lengths_are_refused():
    model = LmModel(mlx_lm_class(IGNORES_LENGTHS), IGNORES_LENGTHS)
    with pytest.raises(ValueError, match="right-padding lengths"):
        model.check_commit()
    family("qwen3_5").check_commit()  # the others keep their state at the lengths


def test_a_recurrent_model_is_refused_as_a_draft_model():
    model = family("qwen3_5")
    with pytest.raises(ValueError, match="recurrent layers"):
        run_decode(
            family("llama"), None, [[1, 2]], max_tokens=2, shape=BeamShape.parse("D1xL3"),
            draft_model=model,
        )  # fmt: skip


N = 2000  # samples per chi-square test
SAMPLED = [1, 3, 2]


def small_vocab(name: str, **extra) -> LmModel:
    """``name`` with a 12-token vocabulary, weights scaled up so the distribution is peaked."""
    config = {**FAMILIES[name], "vocab_size": 12, **extra}
    lm = mlx_lm_class(config)
    scaled = [(k, v * 3.0) for k, v in tree_flatten(lm.parameters()) if "embed" in k]
    lm.load_weights(scaled, strict=False)
    mx.eval(lm.parameters())
    return LmModel(lm, config)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_moe"])
def test_seeded_sampling_is_exact_on_a_hybrid_and_an_moe_model(name):
    model = small_vocab(name)
    hot, cool = SamplerConfig(temperature=1.0), SamplerConfig(temperature=0.5)
    texts = [SAMPLED + plain_small(model)]
    drafter = ReplayDrafter(model, texts, wrong=3)
    shape = BeamShape.parse("W1xL3+K1xL3") if model.recurrent else BeamShape.parse("W2xL3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, stats = run_decode(
            model, drafter, [SAMPLED] * N, max_tokens=2, seed=5, sampler=hot, shape=shape
        )
    counts: dict = {}
    for row in out:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert stats["tokens_per_step"] > 1.1  # drafts were accepted and judged
    assert chi_square_pvalue(counts, lm_joint(model, hot, SAMPLED), N) > 1e-3
    assert chi_square_pvalue(counts, lm_joint(model, cool, SAMPLED), N) < 1e-3  # the test has power


def plain_small(model) -> list[int]:
    return run_decode(model, None, [SAMPLED], max_tokens=8, shape=BeamShape.autoregressive())[0][0]


# -- folders -------------------------------------------------------------------------------


def save_folder(lm, config: dict, path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.parameters())))


def test_a_hybrid_folder_loads_through_mlx_lm_and_speculates(tmp_path):
    config = RECURRENT["qwen3_5"]
    save_folder(mlx_lm_class(config), config, tmp_path / "m")
    model, _ = load_model(tmp_path / "m", mx.float32)
    assert isinstance(model, LmModel) and model.recurrent
    want = plain("qwen3_5")
    got, _ = run_decode(model, None, PROMPTS, max_tokens=TOKENS, shape=BeamShape.lookup_only(1, 4))
    assert got == want


def test_a_llama_with_sliding_layers_decodes_mlx_lm_tokens(tmp_path):
    """``layer_types`` marking sliding layers: mlx-lm's windows, not full attention."""
    config = ATTENTION["llama"]
    assert "sliding_attention" in config["layer_types"] and config["sliding_window"] < 10
    lm = mlx_lm_class(config)
    save_folder(lm, config, tmp_path / "m")
    model, _ = load_model(tmp_path / "m", mx.float32)
    assert isinstance(model, LmModel)
    tokens, cache = [], make_prompt_cache(lm)
    logits = lm(mx.array([PROMPT]), cache=cache)
    for _ in range(12):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = lm(mx.array([[tokens[-1]]]), cache=cache)
    got, _ = run_decode(model, None, [PROMPT], max_tokens=12, shape=BeamShape.autoregressive())
    assert got[0] == tokens


def test_a_family_mlx_lm_lacks_names_its_version_and_the_upgrade(tmp_path):
    import mlx_lm

    config = {**ATTENTION["qwen2"], "model_type": "qwen9_future"}
    save_folder(mlx_lm_class(ATTENTION["qwen2"]), config, tmp_path / "m")
    with pytest.raises(LoadError) as e:
        load_model(tmp_path / "m")
    text = str(e.value)
    assert "qwen9_future" in text and mlx_lm.__version__ in text and "upgrade mlx-lm" in text


def test_a_config_mlx_lm_refuses_gets_its_reason_in_one_line(tmp_path):
    config = ATTENTION["gpt_oss"]
    lm = mlx_lm_class(config)
    weights = dict(tree_flatten(lm.parameters()))
    weights.pop(next(k for k in weights if k.endswith("sinks")))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "m" / "model.safetensors"), weights)
    with pytest.raises(LoadError) as e:
        load_model(tmp_path / "m")
    text = str(e.value)
    assert "mlx-lm" in text and "cannot build this gpt_oss model" in text
    assert "\n" not in text


def test_a_drafter_distilled_for_a_hybrid_model_speculates_losslessly(tmp_path):
    """Self-distillation on a tiny qwen3_5 (its own greedy answers: one causal forward per
    sequence), then the drafter's chains speculate and plain decoding's tokens come out."""
    from redrafter_mlx.train import distill as D
    from redrafter_mlx.train.data import Sequence

    model = family("qwen3_5")
    prompts = [[i % 500 + 1, (7 * i) % 500 + 1, (13 * i) % 500 + 1] for i in range(24)]
    answers, _ = run_decode(model, None, prompts, max_tokens=30, shape=BeamShape.autoregressive())
    sequences = [
        Sequence(p + a, [False] * len(p) + [True] * len(a)) for p, a in zip(prompts, answers)
    ]
    with pytest.raises(ValueError, match="--targets self"):
        D.build_target_cache(model, sequences[:1], 3, "distill", tmp_path / "rollouts")
    cache = D.build_target_cache(model, sequences, 3, "self", tmp_path / "cache")
    opts = D.DistillOptions(predict_tokens=3, lr=3e-3, warmup=0.1, batch_size=64).validate()
    steps = 150
    drafter = D.new_drafter(D.drafter_args(model, opts), seed=0)
    trainer = D.Trainer(drafter, opts, steps)
    order = D.DataOrder(cache.size, opts.batch_size, seed=0)
    for step in range(steps):
        trainer.step([D.read_batch(cache, model, order.batch(step))])
    shape = BeamShape.parse("W1xL4")
    got, stats = run_decode(model, drafter, prompts[:4], max_tokens=30, shape=shape)
    assert got == answers[:4]
    assert stats["tokens_per_step"] > 2.0  # it learnt the model's own answers (3.9 measured)


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "qwen3_moe"])
def test_server_rows_joining_mid_generation_give_their_solo_tokens(name):
    """The server's scheduler over a hybrid / MoE model: requests join a running batch, rows
    are reused, and each answer is the request's plain decoding alone."""
    from redrafter_mlx.serve.scheduler import Request, Scheduler
    from tests.support.serving import Collector, drain

    model = family(name)
    prompts = [p + [i + 1] for i, p in enumerate(PROMPTS * 2)]
    drafter = ReplayDrafter(model, [p + a for p, a in zip(PROMPTS, plain(name))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = Scheduler(model, drafter, BeamShape.parse("W1xL4+K1xL4"), [], max_batch=3)
        runs = []
        for i, prompt in enumerate(prompts):
            sink = Collector()
            sched.submit(Request(prompt, 10 + 3 * i, sink))
            runs.append((prompt, 10 + 3 * i, sink))
            for _ in range(1 + i % 3):
                sched.run_once()
        drain(sched)
    for prompt, max_tokens, sink in runs:
        want, _ = run_decode(
            model, None, [prompt], max_tokens=max_tokens, shape=BeamShape.autoregressive()
        )
        assert sink.tokens == want[0]


def test_parallel_branches_are_refused_on_a_recurrent_model():
    from redrafter_mlx.engine.core.branches import BranchRules
    from redrafter_mlx.serve.scheduler import Scheduler

    rules = BranchRules(fork_id=5, child_id=6)
    with pytest.raises(ValueError, match="--branches off"):
        run_decode(family("qwen3_5"), None, [[1, 2]], max_tokens=2, branches=rules)
    with pytest.raises(ValueError, match="recurrent state"):
        Scheduler(family("qwen3_5"), None, BeamShape.autoregressive(), [], branches=rules)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5"])
def test_a_quantized_folder_with_mixed_bits_loads_as_mlx_lm_loads_it(name, tmp_path):
    """4-bit affine with an 8-bit embedding (mlx-lm's per-layer entries): the logits are
    mlx-lm's own load's, and speculation gives plain decoding's tokens."""
    from mlx_lm.utils import load_model as mlx_lm_load

    config = dict(FAMILIES[name])
    lm = mlx_lm_class(config)
    embedding = next(p for p, m in lm.named_modules() if isinstance(m, nn.Embedding))

    def bits(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 32:
            return False
        return {"group_size": 32, "bits": 8 if path == embedding else 4}

    nn.quantize(lm, group_size=32, bits=4, class_predicate=bits)
    config["quantization"] = {"group_size": 32, "bits": 4, embedding: {"group_size": 32, "bits": 8}}
    save_folder(lm, config, tmp_path / "q")
    model, _ = load_model(tmp_path / "q", mx.float32)
    ref, _ = mlx_lm_load(tmp_path / "q")
    tokens = mx.array([PROMPT])
    want = ref(tokens)[0, -1].astype(mx.float32)
    assert mx.abs(engine_logits(model)[0] - want).max().item() <= 1e-4
    plain_tokens, _ = run_decode(
        model, None, PROMPTS, max_tokens=12, shape=BeamShape.autoregressive()
    )
    drafter = ReplayDrafter(model, [p + a for p, a in zip(PROMPTS, plain_tokens)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = run_decode(model, drafter, PROMPTS, max_tokens=12, shape=BeamShape.parse("W1xL4"))
    assert got == plain_tokens
