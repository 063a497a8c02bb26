"""Saved profiles (atomic, versioned, corruption-tolerant) and resolve_beam_shape."""

from __future__ import annotations

import json
import os

import pytest

from redrafter_mlx.engine.core.shape import BeamShape
from tuning import ShapeChoice, resolve_beam_shape
from tuning.chip import chip_from_facts
from tuning.profiles import Profile, ProfileKey, ProfileStore, profiles_path

M2_MAX = chip_from_facts(
    {"system": "Darwin", "brand_string": "Apple M2 Max", "gpu_cores_text": '"gpu-core-count" = 38'}
)


@pytest.fixture()
def pair(tmp_path):
    """A model dir and a drafter dir with config.json files."""
    model = tmp_path / "model"
    drafter = tmp_path / "drafter"
    model.mkdir()
    drafter.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (drafter / "config.json").write_text(json.dumps({"hidden_size": 64}))
    return model, drafter


def _profile(key: ProfileKey, shape=BeamShape(2, 5), speculative=True) -> Profile:
    return Profile(
        key=key,
        shape=shape,
        speculative=speculative,
        speedup=1.6,
        tokens_per_s=42.0,
        created="2026-11-22T10:00:00+00:00",
        summary={"reason": "test"},
    )


def _key(pair, chip_id="apple-m2-max-38c", dtype="float16", version="0.1.0") -> ProfileKey:
    return ProfileKey.build(chip_id, pair[0], pair[1], dtype, version=version)


def test_path_honours_env(home):
    assert profiles_path() == home / "profiles.json"


def test_one_home_folder_for_everything(tmp_path, monkeypatch):
    """$REDRAFTER_MLX_HOME, else $XDG_CACHE_HOME/redrafter-mlx, else ~/.cache/redrafter-mlx:
    the same folder for profiles, models and the build scripts' work."""
    from redrafter_mlx.engine.base.bundled import home, smollm2_path
    from scripts.build_smollm2_drafter import default_work

    def every_use() -> set:
        here = home()
        uses = {
            profiles_path().parent,
            smollm2_path().parent.parent,
            default_work().parent.parent,
        }
        assert uses == {here}
        return here

    monkeypatch.setenv("REDRAFTER_MLX_HOME", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert every_use() == tmp_path / "explicit"
    monkeypatch.delenv("REDRAFTER_MLX_HOME")
    assert every_use() == tmp_path / "xdg" / "redrafter-mlx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert every_use() == tmp_path / "user" / ".cache" / "redrafter-mlx"


def test_round_trip(home, pair):
    store = ProfileStore()
    profile = _profile(_key(pair))
    store.put(profile)
    assert ProfileStore().get(profile.key) == profile
    other = _profile(_key(pair, chip_id="apple-m1-max-32c"), BeamShape(1, 5))
    store.put(other)
    assert set(ProfileStore().load()) == {profile.key.text, other.key.text}


def test_key_tracks_model_config_and_quantization(pair):
    before = _key(pair)
    assert before.quantization == "none"
    (pair[0] / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization": {"group_size": 64, "bits": 4}})
    )
    after = _key(pair)
    assert after.quantization == "q4g64"
    assert after.model_fingerprint != before.model_fingerprint
    assert after.text != before.text
    hub = ProfileKey.build("c", "mlx-community/some-model", None, None, version="1")
    assert (hub.model, hub.model_fingerprint, hub.drafter) == (
        "mlx-community/some-model",
        "hub",
        "none",
    )


def test_interrupted_write_keeps_old_file_and_leaves_no_temp(home, pair, monkeypatch):
    store = ProfileStore()
    old = _profile(_key(pair))
    store.put(old)
    before = store.path.read_bytes()

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr("tuning.profiles.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.put(_profile(_key(pair, chip_id="apple-m1-max-32c")))
    assert store.path.read_bytes() == before
    assert os.listdir(store.path.parent) == ["profiles.json"]
    assert ProfileStore().get(old.key) == old


def test_crash_while_serialising_keeps_old_file(home, pair, monkeypatch):
    store = ProfileStore()
    store.put(_profile(_key(pair)))
    before = store.path.read_bytes()

    def half_written(payload, f, **_kwargs):
        f.write('{"format": 1, "profi')
        raise OSError("disk full")

    monkeypatch.setattr("tuning.profiles.json.dump", half_written)
    with pytest.raises(OSError, match="disk full"):
        store.put(_profile(_key(pair, chip_id="x")))
    assert store.path.read_bytes() == before
    assert os.listdir(store.path.parent) == ["profiles.json"]


@pytest.mark.parametrize(
    "content", ["{not json", '{"format": 1}', '{"profiles": {"k": 3}}', "[1, 2]"]
)
def test_corrupt_file_warns_once_and_is_ignored(home, pair, content, capsys):
    home.mkdir(parents=True)
    (home / "profiles.json").write_text(content)
    messages = []
    assert ProfileStore(warn=messages.append).load() == {}
    assert len(messages) == 1 and "corrupt" in messages[0]
    choice = resolve_beam_shape(pair[0], pair[1], "float16", chip=M2_MAX)
    assert choice.source == "preset for m2-max"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning:")
    # saving over a corrupt file replaces it
    ProfileStore(warn=messages.append).put(_profile(_key(pair)))
    assert len(ProfileStore().load()) == 1


def test_clear_removes_everything(home, pair):
    store = ProfileStore()
    store.put(_profile(_key(pair)))
    store.put(_profile(_key(pair, chip_id="other")))
    assert store.clear() == 2
    assert not store.path.exists()
    assert store.clear() == 0


# --------------------------------------------------------------------------- resolve_beam_shape


def test_tuned_profile_wins(home, pair):
    key = ProfileKey.build(M2_MAX.chip_id, pair[0], pair[1], "float16")
    ProfileStore().put(_profile(key, BeamShape(3, 5, 9)))
    choice = resolve_beam_shape(pair[0], pair[1], "float16", chip=M2_MAX)
    assert isinstance(choice, ShapeChoice)
    assert (choice.width, choice.length, choice.capacity) == (3, 5, 9)
    assert choice.speculative
    assert choice.source == "tuned profile for apple-m2-max-38c (2026-11-22)"


def test_profile_for_another_dtype_or_model_is_not_used(home, pair, tmp_path):
    key = ProfileKey.build(M2_MAX.chip_id, pair[0], pair[1], "float16")
    ProfileStore().put(_profile(key, BeamShape(3, 5)))
    assert resolve_beam_shape(pair[0], pair[1], "bfloat16", chip=M2_MAX).source == (
        "preset for m2-max"
    )
    (pair[0] / "config.json").write_text('{"model_type": "llama", "hidden_size": 128}')
    assert resolve_beam_shape(pair[0], pair[1], "float16", chip=M2_MAX).source == (
        "preset for m2-max"
    )


def test_version_change_ignores_old_profile(home, pair):
    old = ProfileKey.build(M2_MAX.chip_id, pair[0], pair[1], "float16", version="0.0.1")
    ProfileStore().put(_profile(old, BeamShape(4, 6)))
    choice = resolve_beam_shape(pair[0], pair[1], "float16", chip=M2_MAX)
    assert (choice.width, choice.length) == (2, 5)  # the m2-max preset, not W4×L6
    assert choice.source.startswith("preset for m2-max")
    assert "0.0.1" in choice.source and "re-run" in choice.source


def test_profile_saying_speculation_does_not_pay(home, pair):
    key = ProfileKey.build(M2_MAX.chip_id, pair[0], pair[1], "float16")
    ProfileStore().put(_profile(key, BeamShape.autoregressive(), speculative=False))
    choice = resolve_beam_shape(pair[0], pair[1], "float16", chip=M2_MAX)
    assert not choice.speculative and (choice.width, choice.length) == (1, 1)
    assert "plain decoding" in choice.source


def test_presets_and_default(home, pair):
    assert resolve_beam_shape(pair[0], pair[1], None, chip="m2-ultra").to_dict() == {
        "width": 3,
        "length": 4,
        "capacity": None,
        "source": "preset for m2-ultra",
        "speculative": True,
        "label": "W3×L4",
    }
    unknown = chip_from_facts({"system": "Darwin", "brand_string": "Apple M9 Max"})
    choice = resolve_beam_shape(pair[0], pair[1], None, chip=unknown)
    assert choice.source == "default preset (no profile for this chip)"
    assert choice.shape == BeamShape(2, 4)


def test_length_capped_by_drafter_training(home, pair):
    (pair[1] / "config.json").write_text(json.dumps({"hidden_size": 64, "predict_tokens": 2}))
    choice = resolve_beam_shape(pair[0], pair[1], None, chip="m2")  # preset W2×L5
    assert (choice.width, choice.length) == (2, 3)
    assert "capped at 3" in choice.source


def test_detects_this_machine_by_default(home, pair):
    choice = resolve_beam_shape(pair[0], pair[1], None)
    assert choice.width >= 1 and choice.length >= 1 and choice.source
