"""A model's own MTP layers as a draft source (``engine/drafting/mtp_source.py``): greedy
output equals plain decoding, alone and with the drafter and lookup in one tree, solo and
batched; after every step the head's state holds exactly the committed text's entries (the
commit's ``absorb``, whichever source won); the fixture head of the published format loads
through the draft slot; a head that does not fit is refused in one line."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig, row_keys_of, row_settings
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.step import batch_step
from redrafter_mlx.engine.drafting.head_sources import MtpSource
from redrafter_mlx.engine.drafting.heads import HeadMismatch, load_head
from redrafter_mlx.engine.drafting.heads.mtp import MtpHead
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import MTP, SOURCE_NAMES
from tests.support.heads import assert_state_follows_the_text
from tests.support.models import greedy_prefilled, run_decode, tiny_drafter, tiny_model
from tests.support.paths import FIXTURES

FIXTURE = FIXTURES / "heads" / "qwen3_5_mtp"
PROMPTS = [[1, 5, 2, 3, 5, 7], [2, 7, 7, 4], [3, 3, 6, 1, 2, 3, 6, 1, 2]]


def tiny_head(vocab: int = 8, hidden: int = 32, seed: int = 4) -> MtpHead:
    """A random one-layer Qwen3.5 MTP head for a target of ``hidden`` and ``vocab``."""
    config = json.loads((FIXTURE / "config.json").read_text())
    config["text_config"].update(vocab_size=vocab, hidden_size=hidden)
    head = MtpHead(config)
    mx.random.seed(seed)
    head.update(
        {k: v for k, v in _scaled(head.parameters(), seed).items()}  # peaked enough to agree
    )
    mx.eval(head.parameters())
    return head


def _scaled(tree, seed: int):
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    out = []
    for i, (name, a) in enumerate(tree_flatten(tree)):
        k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.key(i)
        noise = mx.random.normal(a.shape, key=k) * 0.3
        out.append((name, a + noise if "norm" in name else noise))
    return tree_unflatten(out)


def plain(model, prompts, n=24):
    out, _ = run_decode(model, None, prompts, max_tokens=n, shape=AR)
    return out


@pytest.mark.parametrize("label", ["D1xL3", "D1xL5", "K1xL6+D1xL4", "W2xL3+D1xL4"])
def test_greedy_output_equals_plain_decoding_batched_and_solo(label):
    model = tiny_model(3, vocab=8, layers=2)
    head = tiny_head()
    drafter = tiny_drafter(model, 4)
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    got, stats = run_decode(model, drafter, PROMPTS, max_tokens=24, shape=shape, draft_model=head)
    assert got == want
    for r, prompt in enumerate(PROMPTS):  # each row alone: another row changes nothing
        solo, _ = run_decode(model, drafter, [prompt], max_tokens=24, shape=shape, draft_model=head)
        assert solo[0] == want[r]
    assert "mtp" in SOURCE_NAMES and set(stats["source_tokens"]) == set(SOURCE_NAMES)


def test_the_chain_is_accepted_sometimes_and_plain_steps_keep_its_state():
    """Adaptive runs mix plain steps, lookup and the head: the output is plain decoding's and
    the head's drafts are accepted (its state is right after steps without it)."""
    model = tiny_model(3, vocab=8, layers=2)
    head = tiny_head()
    want = plain(model, PROMPTS, 40)
    got, stats = run_decode(model, None, PROMPTS, max_tokens=40, draft_model=head)
    assert got == want
    assert stats["source_tokens"]["mtp"] > 0, stats


def test_state_holds_the_committed_texts_entries_after_every_step():
    """After each step (its path accepted from the head, lookup or nothing), the head's state
    equals a prefill of the committed text at every committed position but the last (the
    entry that needs the token after it, written by the next draft)."""
    model = tiny_model(3, vocab=8, layers=2)
    head = tiny_head()
    source = MtpSource(head)
    slots, prompt = 64, [1, 5, 2, 3, 5, 7, 1, 5]

    def committed(model, text):  # the head's state from scratch for ``text``
        session = Session(model, 1)
        session.cached = [text]
        session.ensure_slots(slots)
        return source.prefill(model, session, slice(0, 1))

    for label in ("K1xL4+D1xL4", None):  # a tree with the head and lookup; plain decoding
        shape = BeamShape.parse(label) if label else None
        state = greedy_prefilled(model, prompt, slots, sources=(committed(model, prompt),))
        step = held_step(model, shape, head)
        won = set()
        for _ in range(8):
            state, out = step(state, slots)
            won.add(int(out.source[0]) if out.source is not None else -1)
            n = int(state.lengths[0])
            want = committed(model, state.history[0, :n].tolist())
            for got, ref in zip(state.sources[0], want):
                for a, b in zip(got, ref):
                    assert mx.allclose(a[:, :, : n - 1], b[:, :, : n - 1], atol=1e-4).item()
        if label:
            assert MTP in won or len(won) > 1, won


def held_step(model, shape, head):
    """The loop's greedy one-row step of ``shape`` (None: plain decoding) holding ``head`` in
    the draft slot whether or not the shape runs it (as the loop does)."""
    mode, settings = row_settings([SamplerConfig()], model.vocab_size)
    step = batch_step(model, held_sources(None, head), shape, mode)
    keys, active = row_keys_of(mx.random.key(0), 1), mx.ones((1,), mx.bool_)

    def run(state, window):
        state, _, out = step(state, keys, active, settings, window)
        return state, out

    return run


def test_the_published_fixture_head_loads_into_the_draft_slot_and_is_lossless():
    head = load_head(FIXTURE, mx.float32)
    model = tiny_model(5, vocab=128, hidden=32, layers=2)
    want = plain(model, PROMPTS[:2], 12)
    got, _ = run_decode(
        model, None, PROMPTS[:2], max_tokens=12, shape=BeamShape.parse("D1xL4"), draft_model=head
    )
    assert got == want


def test_a_head_for_another_model_is_refused_in_one_line():
    model = tiny_model(5, vocab=64, hidden=32, layers=2)
    with pytest.raises(HeadMismatch, match="vocabulary has 128 ids, the model's 64") as e:
        run_decode(
            model, None, PROMPTS[:1], max_tokens=4, shape=BeamShape.parse("D1xL3"),
            draft_model=load_head(FIXTURE, mx.float32),
        )  # fmt: skip
    assert "\n" not in str(e.value)


def test_an_mtp_sidecar_folder_loads_through_draft_model_and_decodes_plain_tokens(tmp_path):
    """A sidecar in mlx-vlm's layout (``model_type: qwen3_5_mtp``) for the demo model, given
    as ``--draft-model`` (``load``'s ``draft_model``), joins the draft slot as the MTP
    source; the answer equals plain decoding's."""
    from mlx.utils import tree_flatten

    from redrafter_mlx.engine.base.bundled import demo_paths
    from redrafter_mlx.engine.loop.generation import batch_generate
    from redrafter_mlx.engine.loop.loading import load

    demo = demo_paths()[0]
    config = json.loads((FIXTURE / "config.json").read_text())["text_config"]
    config.update(model_type="qwen3_5_mtp", hidden_size=256, vocab_size=4096)
    folder = tmp_path / "mtp"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    head = MtpHead(config)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(head.parameters())))
    model, _, tokenizer, slot = load(demo, draft_model=str(folder), dtype="float32")
    assert isinstance(slot, MtpSource)
    prompts = [tokenizer.encode("The cat"), tokenizer.encode("Once upon a time")]
    want = batch_generate(model, None, tokenizer, prompts, max_tokens=16, shape=AR)
    got = batch_generate(
        model, None, tokenizer, prompts, max_tokens=16, shape=BeamShape.parse("D1xL4"),
        draft_model=slot,
    )  # fmt: skip
    assert got == want


# ---------------------------------------------------------------------------- EAGLE-3

EAGLE3 = FIXTURES / "heads" / "eagle3"


def eagle3_pair():
    """The published-format fixture head (aux hidden states 2, 3, 5; draft vocabulary of 64
    ids) and a tiny 6-layer target of its sizes, the head's source sized for it."""
    from redrafter_mlx.engine.drafting.head_sources import as_head_source

    model = tiny_model(5, vocab=128, hidden=32, layers=6)
    head = load_head(EAGLE3, mx.float32)
    return model, as_head_source(head, model)


def test_eagle3_taps_the_layers_its_config_names_and_is_lossless_batched_and_solo():
    from redrafter_mlx.engine.loop.run import Run

    model, source = eagle3_pair()
    assert source.feature_layers == (2, 3, 5)
    want = plain(model, PROMPTS, 16)
    for label in ("D1xL4", "K1xL5+D1xL3"):
        shape = BeamShape.parse(label)
        got, _ = run_decode(model, None, PROMPTS, max_tokens=16, shape=shape, draft_model=source)
        assert got == want, label
        assert model.feature_layers == (2, 3, 5)  # the run tapped the head's layers
        solo, _ = run_decode(
            model, None, PROMPTS[2:], max_tokens=16, shape=shape, draft_model=source
        )
        assert solo[0] == want[2]
    assert Run.of_sources(model, held_sources(None, source), None).model is model


def test_eagle3_state_holds_the_committed_texts_entries_after_every_step():
    model, source = eagle3_pair()
    assert_state_follows_the_text(model, source, [1, 5, 2, 3, 5, 7, 1, 5])


def test_an_eagle3_folder_loads_through_draft_model_and_a_misfit_is_refused():
    from redrafter_mlx.engine.drafting.head_sources import Eagle3Source, head_source

    model = tiny_model(5, vocab=128, hidden=32, layers=6)
    assert isinstance(head_source(EAGLE3, model, mx.float32), Eagle3Source)
    shallow = tiny_model(5, vocab=128, hidden=32, layers=5)  # hidden state 5 is its output
    with pytest.raises(HeadMismatch, match="last layer") as e:
        head_source(EAGLE3, shallow, mx.float32)
    assert "\n" not in str(e.value)


def test_the_mtp_head_drafts_losslessly_for_a_hybrid_qwen3_5_target():
    """Its own family's target: a tiny Qwen3.5 (Gated DeltaNet and attention layers), whose
    steps verify chains; batched and solo, the output is plain decoding's."""
    from redrafter_mlx.engine.verifier.lm_model import from_config

    config = json.loads((FIXTURE / "config.json").read_text())
    model = from_config(config, mx.float32)
    assert model.recurrent
    head = load_head(FIXTURE, mx.float32)
    want = plain(model, PROMPTS, 12)
    for label in ("D1xL3", "K1xL4+D1xL4"):
        shape = BeamShape.parse(label)
        got, _ = run_decode(model, None, PROMPTS, max_tokens=12, shape=shape, draft_model=head)
        assert got == want, label
        solo, _ = run_decode(model, None, PROMPTS[:1], max_tokens=12, shape=shape, draft_model=head)
        assert solo[0] == want[0]


def test_self_mtp_reads_the_models_own_mtp_layers_or_says_it_has_none(tmp_path):
    """``--draft-model self-mtp``: the MTP layers in the model's own checkpoint (the fixture
    is a Qwen3.5 checkpoint's ``mtp.*`` tensors under their published names)."""
    from redrafter_mlx.engine.loop.loading import LoadError, draft_slot_paths, self_mtp
    from redrafter_mlx.engine.verifier.lm_model import from_config

    assert draft_slot_paths("self-mtp") == ("self-mtp", None)
    model = from_config(json.loads((FIXTURE / "config.json").read_text()), mx.float32)
    source = self_mtp(model, FIXTURE, mx.float32)
    assert isinstance(source, MtpSource)
    want = plain(model, PROMPTS[:1], 8)
    got, _ = run_decode(
        model, None, PROMPTS[:1], max_tokens=8, shape=BeamShape.parse("D1xL3"), draft_model=source
    )
    assert got == want
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(LoadError, match="declares no MTP layers") as e:
        self_mtp(tiny_model(0), tmp_path)
    assert "\n" not in str(e.value)


def test_sampling_with_an_mtp_head_is_exact():
    """The head's chain, merged with a lookup chain in one tree: the sequence distribution
    matches the target's own (chi-square; its power check is test_sampling's biased one)."""
    import tests.support.sampling as sampling
    from tests.support.models import near_bigram_model

    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    counts, stats = sampling.sample_counts(
        model, None, cfg, n, seed=99, shape=BeamShape.parse("K1xL3+D1xL4"), adapt=False,
        draft_model=tiny_head(vocab=6),
    )  # fmt: skip
    assert stats["source_tokens"]["mtp"] > 0.05 * n  # its drafts are really tested
    assert sampling.chi_square_pvalue(counts, sampling.exact_joint(model, cfg), n) > 1e-3


def test_server_rows_with_an_mtp_head_equal_solo_plain_decoding():
    """Rows join mid-way (more requests than rows: resizes, placements, the head's state
    prefilled per joining row): each row's output equals plain decoding; the memory check
    counts the head's weights and cache; ``/health`` would name it (``describe``)."""
    from redrafter_mlx.engine.loop.memory import check_step_memory
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    model = tiny_model(3, vocab=8, layers=2)
    head = tiny_head()
    prompts = [[1, 5, 2, 3, 5, 7], [2, 7, 7, 4], [3, 3, 6, 1, 2, 3, 6, 1, 2], [4, 4]]
    sched = Scheduler(
        model, None, BeamShape.parse("K1xL5+D1xL4"), (), max_batch=2, draft_model=head
    )
    sinks = staggered(sched, prompts, [16 + 4 * i for i in range(len(prompts))])
    accepted = 0
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        want, _ = run_decode(model, None, [prompt], max_tokens=16 + 4 * i, shape=AR)
        assert sink.tokens == want[0], i
        accepted += sink.last.stats.by_source[MTP]
    assert accepted > 0
    source = MtpSource(head)
    assert source.describe() == "mtp (1 MTP layer)"
    shape = BeamShape.parse("D1xL4")
    alone = check_step_memory(model, held_sources(), BeamShape.parse("K1xL4"), tokens=128)
    with_head = check_step_memory(model, held_sources(None, source), shape, tokens=128)
    assert with_head.weights > alone.weights and with_head.cache > alone.cache
