"""The draft slot and the pinned shape misused as a user would: a path where a loaded draft
model goes (and the reverse), a shape part with no source, an empty or missing
``--draft-model``, a drafter or early-exit folder in the wrong flag, ``--no-draft`` with
``--draft-model``, a draft model with another tokenizer (two ids swapped), and a draft model
whose vocabulary lacks the target's added ids (allowed: it is never fed an id it lacks, and
greedy output equals plain decoding). Each refusal is one clear error naming the problem and
the fix, before anything is loaded or run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import redrafter_mlx as api
from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.draft_model import DraftModelSource, prefill
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitArgs, save_adapter
from redrafter_mlx.engine.drafting.sources import DraftContext
from redrafter_mlx.engine.loop.loading import LoadError, load
from tests.support.cli import error_line, invoke
from tests.support.models import run_decode, save_model_dir, tiny_model

DEMO, DEMO_DRAFTER = demo_paths()


@pytest.fixture(scope="module")
def demo():
    """(model, drafter, tokenizer) of the bundled demo model."""
    return load(DEMO, DEMO_DRAFTER)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, demo) -> Path:
    """A (random) early-exit adapter for the demo model."""
    folder = tmp_path_factory.mktemp("ee") / "ee"
    save_adapter(folder, EarlyExitAdapter(EarlyExitArgs.for_target(demo[0].args, 1)))
    return folder


def generate(app, *args):
    return invoke(app, "generate", "--model", "demo", "-p", "def f(", "-n", 3, *args)


# --------------------------------------------------------------------------- the API's types


@pytest.mark.parametrize("path", [str(DEMO), DEMO])
def test_a_path_as_generate_draft_model_says_how_to_load_it(demo, path):
    model, drafter, tokenizer = demo
    with pytest.raises(TypeError, match=r"draft_model takes a loaded .* load it first") as e:
        api.generate(model, drafter, tokenizer, "def f(", max_tokens=2, draft_model=path)
    assert f"draft_model={str(DEMO)!r}" in str(e.value)
    with pytest.raises(TypeError, match="draft_model takes a loaded"):
        api.batch_generate(model, drafter, tokenizer, ["def f("], max_tokens=2, draft_model=path)


def test_a_path_as_generate_drafter_says_how_to_load_it(demo):
    model, _, tokenizer = demo
    with pytest.raises(TypeError, match=r"drafter takes a loaded drafter .* redrafter_mlx.load"):
        api.generate(model, str(DEMO_DRAFTER), tokenizer, "def f(", max_tokens=2)


@pytest.mark.parametrize(
    "value, says",
    [
        (5, "got int 5"),
        ([str(DEMO), 5], "got a list holding int 5"),
        (object(), "got object"),
    ],
)
def test_load_draft_model_takes_paths_only(value, says):
    with pytest.raises(TypeError, match="load's draft_model takes a path or Hub id") as e:
        load(DEMO, draft_model=value)
    assert says in str(e.value)


def test_a_loaded_model_as_load_draft_model_is_sent_to_generate(demo):
    with pytest.raises(TypeError, match="a loaded one goes to generate's draft_model"):
        load(DEMO, draft_model=demo[0])


# --------------------------------------------------------------------------- pinned shapes


@pytest.mark.parametrize(
    "with_drafter, shape, says",
    [
        (False, "D1xL4", "D1×L4) but draft_model is None"),
        (True, "W1xL3+D1xL4", "D1×L4) but draft_model is None"),
        (True, BeamShape.parse("K1xL6+D1xL3"), "D1×L3) but draft_model is None"),
        (False, "W2xL3", "W2×L3) but drafter is None"),
        (False, "W1xL3+K1xL8", "W1×L3) but drafter is None"),
    ],
)
def test_a_pinned_shape_part_without_its_source_is_refused(demo, with_drafter, shape, says):
    model, drafter, tokenizer = demo
    drafter = drafter if with_drafter else None
    for call in (api.generate, api.stream_generate):
        with pytest.raises(ParamError, match="but .* is None") as e:
            list(call(model, drafter, tokenizer, "def f(", max_tokens=2, shape=shape))
        assert says in str(e.value) and e.value.param == "shape"
    with pytest.raises(ParamError, match=says.replace("(", r"\(").replace(")", r"\)")):
        api.batch_generate(model, drafter, tokenizer, ["def f("], max_tokens=2, shape=shape)


def test_a_pinned_shape_with_its_sources_runs(demo):
    model, _, tokenizer = demo
    plain = api.generate(model, None, tokenizer, "def f(", max_tokens=6, shape=AR)
    own = api.generate(
        model, None, tokenizer, "def f(", max_tokens=6, shape="D1xL4", draft_model=model
    )
    lookup = api.generate(model, None, tokenizer, "def f(", max_tokens=6, shape="K1xL8")
    assert own == lookup == plain


def test_bench_configs_refuse_by_the_same_rule(cli_app):
    bench = ["bench", "--model", "demo", "-n", 2, "--num-prompts", 1, "--configs"]
    line = error_line(invoke(cli_app, *bench, "D1xL4"), 2)
    assert "D1xL4 need a draft model; add --draft-model" in line.replace("×", "x")


# --------------------------------------------------------------------------- --draft-model paths


def test_an_empty_draft_model_path_is_refused(cli_app):
    line = error_line(generate(cli_app, "--draft-model", ""), 2)
    assert "--draft-model '' is an empty path" in line and "drop --draft-model" in line
    with pytest.raises(LoadError, match="the draft model's path is empty"):
        load(DEMO, draft_model="")


def test_a_missing_draft_model_folder_names_the_flag(cli_app, tmp_path):
    missing = tmp_path / "no" / "such"
    line = error_line(generate(cli_app, "--draft-model", missing), 1)
    assert f"--draft-model {missing}: no such folder" in line


def test_a_drafter_folder_as_draft_model_or_model_is_named(cli_app, tmp_path):
    line = error_line(generate(cli_app, "--draft-model", DEMO_DRAFTER), 1)
    assert "is a ReDrafter drafter's folder, not a model" in line and "--drafter" in line
    line = error_line(invoke(cli_app, "generate", "--model", DEMO_DRAFTER, "-p", "x"), 1)
    assert "is a ReDrafter drafter's folder, not a model" in line and "mlx-lm" not in line
    bare = tmp_path / "drafter"  # no model_type: told by its keys
    shutil.copytree(DEMO_DRAFTER, bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "model_type": None}))
    with pytest.raises(LoadError, match="drafter's folder, not a model, given as a draft model"):
        load(DEMO, draft_model=bare)


def test_an_adapter_folder_as_model_is_named(cli_app, adapter_dir):
    line = error_line(invoke(cli_app, "generate", "--model", adapter_dir, "-p", "x"), 1)
    assert "is an early-exit adapter's folder, not a model" in line
    assert "pass it as --draft-model, or --drafter" in line and "model_type" not in line


def test_no_draft_with_a_draft_model_is_refused_before_loading(cli_app, tmp_path):
    line = error_line(generate(cli_app, "--no-draft", "--draft-model", tmp_path / "none"), 2)
    assert "--no-draft decodes plainly" in line and "drop --draft-model" in line


# --------------------------------------------------------------------------- tokenizers


def demo_copy(folder: Path, edit=None, model=None) -> Path:
    """The demo model's folder copied (its weights linked), its SentencePiece model changed
    by ``edit(proto)``; ``model``: other weights (a tiny model) in its place."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    folder.mkdir(parents=True)
    for f in DEMO.iterdir():
        if f.name != "model.safetensors" or model is None:
            (folder / f.name).symlink_to(f)
    if model is not None:
        (folder / "config.json").unlink()
        save_model_dir(model, folder)
    if edit is not None:
        proto = pb.ModelProto()
        proto.ParseFromString((DEMO / "tokenizer.model").read_bytes())
        edit(proto)
        (folder / "tokenizer.model").unlink()
        (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    return folder


def swap_300_301(proto) -> None:
    a, b = proto.pieces[300].piece, proto.pieces[301].piece
    proto.pieces[300].piece, proto.pieces[301].piece = b, a


def test_a_draft_model_with_two_ids_swapped_is_refused(tmp_path):
    swapped = demo_copy(tmp_path / "swapped", swap_300_301)
    with pytest.raises(LoadError, match=r"another tokenizer than the model .* id 300 is '\):'"):
        load(DEMO, draft_model=swapped)


def add_split_tokens(proto) -> None:
    for name in ("[SplitMask]", "[SplitSop]"):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = name, 0.0, 4  # USER_DEFINED


def test_a_draft_model_without_the_targets_added_ids_loads(tmp_path):
    target = demo_copy(tmp_path / "apar", add_split_tokens, tiny_model(vocab=4098, hidden=32))
    draft = demo_copy(tmp_path / "draft", model=tiny_model(3, vocab=4096, hidden=16, heads=2))
    model, _, tokenizer, own = load(target, draft_model=draft)
    assert (model.vocab_size, own.vocab_size, tokenizer.vocab_size) == (4098, 4096, 4098)
    swapped = demo_copy(tmp_path / "swapped", swap_300_301, tiny_model(3, vocab=4096, hidden=16))
    with pytest.raises(LoadError, match="another tokenizer"):  # a prefix, id for id
        load(target, draft_model=swapped)


# --------------------------------------------------------------------------- added ids


class Recording:
    """A draft model that records the largest id each of its forwards reads (run eagerly)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, *args):
        self.seen.append(int(mx.max(tokens).item()))
        return self.inner(tokens, *args)


ADDED = [[1, 48, 5, 9, 49, 3], [2, 49, 49, 7, 48], [3, 8, 1, 2]]  # 48, 49: the target's only


def test_the_draft_model_never_reads_an_id_it_lacks():
    target = tiny_model(3, vocab=50, layers=2)
    draft = Recording(tiny_model(11, vocab=48, layers=1, hidden=16, heads=2, kv_heads=1))
    slots = 16
    cache = prefill(draft, ADDED, slots)
    history = mx.array([row + [49] * (slots - len(row)) for row in ADDED], mx.int32)
    lengths = mx.array([len(row) for row in ADDED], mx.int32)
    init = mx.array([49, 48, 2], mx.int32)
    hidden = mx.zeros((len(ADDED), target.hidden_size))
    ctx = DraftContext(target, hidden, init, lengths, history, slots, own=cache)
    source = DraftModelSource(draft, 4, 3)
    state, _ = source.catch_up(ctx, 4)
    proposal = source.propose(ctx._replace(own=state))
    assert len(draft.seen) > 3 and max(draft.seen) < 48  # prefill, catch-up and drafts
    chain = proposal.tokens[:, 0].tolist()
    assert [row[0] for row in chain] == [49, 48, 2]  # the init token, as the target has it
    assert max(t for row in chain for t in row[1:]) < 48


@pytest.mark.parametrize("label", ["D1xL4", "K1xL6+D1xL3"])
def test_a_draft_model_without_the_added_ids_decodes_as_plain(label):
    target = tiny_model(3, vocab=50, layers=2)
    draft = tiny_model(11, vocab=48, layers=1, hidden=16, heads=2, kv_heads=1)
    want, _ = run_decode(target, None, ADDED, max_tokens=24, shape=AR)
    got, stats = run_decode(
        target, None, ADDED, max_tokens=24, shape=BeamShape.parse(label), draft_model=draft
    )
    assert got == want
    assert stats["source_tokens"]["draft_model"] > 0  # it drafted, and was accepted at times
    with pytest.raises(ValueError, match=r"vocabulary \(40 ids\) differs .* up to 8 added"):
        run_decode(
            target,
            None,
            ADDED,
            max_tokens=4,
            shape=BeamShape.parse(label),
            draft_model=tiny_model(1, vocab=40, layers=1, hidden=16),
        )
