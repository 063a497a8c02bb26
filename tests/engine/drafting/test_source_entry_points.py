"""A draft source a third-party package registers (the entry point group
``redrafter_mlx.sources``) is reachable from the command line: a folder whose config.json
names its kind, passed as ``--draft-model``, joins the draft slot as that source and
speculates losslessly. The package here is written to a temporary folder with its
``dist-info`` (what ``pip install`` leaves), so nothing is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.drafting import kinds
from redrafter_mlx.engine.loop.loading import LoadError, load
from tests.support.paths import ROOT

DEMO = demo_paths()[0]

PACKAGE = '''
import mlx.core as mx

from redrafter_mlx import DraftContext, DraftSource, Proposal, register_source
from redrafter_mlx.engine.drafting.sources import ABSENT


class Repeat(DraftSource):
    """The tokens that followed the latest earlier occurrence of the init token."""

    source_id = register_source("repeat_after")

    def propose(self, ctx: DraftContext) -> Proposal:
        history, lengths, init = ctx.history, ctx.lengths, ctx.init_token
        B, S = history.shape
        slots = mx.arange(S)[None, :]
        seen = (history == init[:, None]) & (slots < lengths[:, None])
        last = mx.max(mx.where(seen, slots, -1), axis=1)
        at = last[:, None] + mx.arange(1, self.length)[None, :]
        ok = (last[:, None] >= 0) & (at < lengths[:, None])
        drafts = mx.take_along_axis(history, mx.clip(at, 0, S - 1), axis=1)
        present = mx.concatenate([mx.ones((B, 1), mx.bool_), ok], axis=1)
        present = mx.cumprod(present.astype(mx.int32), axis=1) > 0
        tokens = mx.concatenate([init[:, None], drafts], axis=1).astype(mx.int32)
        return Proposal(mx.where(present, tokens, ABSENT)[:, None], present[:, None], rank=1)


def load(folder, model, tokenizer=None, dtype=None):
    return Repeat()
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder holding the package and its dist-info, on sys.path; the source's folder."""
    site = tmp_path / "site"
    (site / "repeat_after_pkg").mkdir(parents=True)
    (site / "repeat_after_pkg" / "__init__.py").write_text(PACKAGE)
    info = site / "repeat_after_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repeat-after-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[redrafter_mlx.sources]\nrepeat-after = repeat_after_pkg:load\n"
    )
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"kind": "repeat-after"}))
    monkeypatch.syspath_prepend(str(site))
    return site, folder


def test_the_folder_loads_as_the_registered_source(site):
    _, folder = site
    assert kinds.is_source_folder(folder) and "repeat-after" in kinds.registered()
    _, _, _, slot = load(DEMO, draft_model=str(folder))
    assert type(slot).__name__ == "Repeat"
    with pytest.raises(LoadError, match="pass it as --draft-model"):
        load(str(folder))


def test_an_unregistered_kind_is_not_taken_for_one(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"kind": "nobody-registers-this"}))
    assert not kinds.is_source_folder(folder)
    with pytest.raises(ValueError, match="no installed package registers"):
        kinds.load_source(folder, None)


def generate(args: list[str], site: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    cmd = [sys.executable, "-m", "redrafter_mlx.cli", "generate", "--model", "demo", *args]
    prompt = ["--prompt", "def f(x):\n    return x\n\ndef f(x):", "--max-tokens", "32"]
    done = subprocess.run(
        [*cmd, *prompt, "--json", "--no-adapt"], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_generate_runs_it_from_the_command_line_losslessly(site):
    where, folder = site
    plain = generate(["--no-draft"], where)
    fast = generate(["--draft-model", str(folder)], where)
    assert fast["tokens"] == plain["tokens"]
    assert "repeat_after" in json.dumps(fast)  # its accepted drafts counted under its name
