"""The bundled demo model: artefacts load, tokenizer round-trips code, corpus build is
deterministic."""

from __future__ import annotations

import json
from pathlib import Path

from redrafter_mlx.engine.base.bundled import DEMO_NOTE, demo_paths, heldout_prompts_path
from scripts import build_demo as build

CODE = (
    "class Foo(Bar):\n"
    '    """A docstring."""\n'
    "\n"
    "    def f(self, x=1, *args, **kw):\n"
    "        if x:\n"
    "\t\treturn {'a': [1, 2.5e-3]}  # tab-indented, unicode: é → ∑\n"
    "        return x   +   12345\n"
    "\n\n"
    "  \n"
    "\n"
)


def test_demo_paths_point_at_files():
    base, drafter = demo_paths()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (base / name).is_file(), name
    assert drafter is None or (drafter / "config.json").is_file()
    assert "bundled demo model" in DEMO_NOTE and "--model" in DEMO_NOTE


def test_base_config_and_size():
    base, _ = demo_paths()
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    for k in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "vocab_size",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert k in cfg, k
    # Shipped package data budget: base <= ~20 MB fp16, leaving room for a drafter.
    assert (base / "model.safetensors").stat().st_size <= 20_000_000


def test_base_loads_with_mlx_lm_and_generates():
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    base, _ = demo_paths()
    model, tokenizer = mlx_lm.load(str(base))
    params = dict(tree_flatten(model.parameters()))
    assert "model.embed_tokens.weight" in params and "lm_head.weight" not in params
    assert all(v.dtype == mx.float16 for v in params.values())
    prompt = build.chat_prompt("Write a Python function `add(a, b)`: Return the sum of a and b.")
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1  # BOS
    text = mlx_lm.generate(model, tokenizer, prompt=ids, max_tokens=8, verbose=False)
    assert isinstance(text, str) and len(text) > 0


def test_tokenizer_roundtrip_and_special_ids():
    import sentencepiece as spm

    base, _ = demo_paths()
    sp = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    assert sp.get_piece_size() == json.loads((base / "config.json").read_text())["vocab_size"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert sp.id_to_piece(1) == "<s>" and sp.id_to_piece(2) == "</s>"
    assert sp.decode(sp.encode(CODE)) == CODE
    # Indentation runs are single pieces.
    assert "▁▁▁▁" in sp.encode("x\n    y", out_type=str)
    # Round trip on real held-out-like code from the stdlib.
    src = Path(build.stdlib_root() / "textwrap.py").read_text()
    assert sp.decode(sp.encode(src)) == src
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "LlamaTokenizer"
    assert cfg["bos_token"]["content"] == "<s>" and cfg["eos_token"]["content"] == "</s>"


def test_hf_tokenizer_matches_sentencepiece():
    import sentencepiece as spm
    from transformers import AutoTokenizer

    base, _ = demo_paths()
    sp = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(str(base))
    for text in (CODE, build.chat_prompt("Write a Python function `f(x)`: Do it.")):
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
        assert tok.decode(sp.encode(text)) == text


def test_heldout_prompts():
    lines = heldout_prompts_path().read_text().splitlines()
    assert 30 <= len(lines) <= 80
    for line in lines:
        rec = json.loads(line)
        assert isinstance(rec["turns"], list) and len(rec["turns"]) == 1
        assert rec["turns"][0].startswith("Write a Python ")


def test_chat_examples_format():
    src = (
        "class A(B):\n"
        '    """Doc of A."""\n'
        "    @property\n"
        "    def m(self, k=2):\n"
        '        """Return k times two."""\n'
        "        return k * 2\n"
        "\n"
        "def top(a, *, b=None):\n"
        '    """Top-level function here."""\n'
        "    return a\n"
    )
    exs = {e["name"]: e for e in build.chat_examples_from_source(src)}
    assert (
        exs["top"]["request"]
        == "Write a Python function `top(a, *, b=None)`: Top-level function here."
    )
    assert (
        exs["m"]["request"]
        == "Write a Python method `m(self, k=2)` of class `A`: Return k times two."
    )
    # Methods are dedented and keep their decorators.
    assert exs["m"]["reply"].startswith('@property\ndef m(self, k=2):\n    """')
    assert exs["A"]["request"] == "Write a Python class `A(B)`: Doc of A."
    text = build.chat_text(exs["top"]["request"], exs["top"]["reply"])
    assert text == (
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions. "
        "USER: Write a Python function "
        "`top(a, *, b=None)`: Top-level function here. ASSISTANT: def top(a, *, b=None):\n"
        '    """Top-level function here."""\n    return a\n'
    )
    assert build.chat_prompt("hi").endswith(" USER: hi ASSISTANT:")


def test_corpus_excludes_tests_and_is_sorted():
    files = build.list_corpus_files(build.stdlib_root())
    assert files == sorted(files) and len(files) > 300
    assert not any(f.split("/")[0] in {"test", "site-packages"} for f in files)
    assert not any("/tests/" in f or "/test/" in f or "idle_test" in f for f in files)
    assert not any(f.startswith("encodings/") or "_sysconfigdata" in f for f in files)


def test_corpus_stage_is_deterministic(tmp_path):
    root = build.stdlib_root()
    files = [
        f for f in build.list_corpus_files(root) if f.startswith(("json/", "textwrap", "shlex"))
    ]
    assert len(files) >= 5
    m1 = build.build_corpus(
        tmp_path / "a", root=root, files=files, out=tmp_path / "a_out", n_prompts=5
    )
    m2 = build.build_corpus(
        tmp_path / "b", root=root, files=list(reversed(files)), out=tmp_path / "b_out", n_prompts=5
    )
    assert m1["corpus_sha256"] == m2["corpus_sha256"]
    assert (tmp_path / "a_out/heldout_prompts.jsonl").read_bytes() == (
        tmp_path / "b_out/heldout_prompts.jsonl"
    ).read_bytes()
    recs = build.load_corpus(tmp_path / "a")
    assert {r["kind"] for r in recs} == {"source", "chat"}
    held = {r["path"] for r in recs if r["split"] == "heldout"}
    assert held == {
        f for i, f in enumerate(files) if i % build.HELDOUT_EVERY == build.HELDOUT_EVERY - 1
    }


def test_distill_data_is_training_chats(tmp_path):
    root = build.stdlib_root()
    files = [f for f in build.list_corpus_files(root) if f.startswith("json/")]
    build.build_corpus(tmp_path, root=root, files=files)
    recs = [
        json.loads(line) for line in build.write_distill_data(tmp_path).read_text().splitlines()
    ]
    assert recs and all(set(r) == {"prompt", "response"} for r in recs)
    assert all(r["prompt"].startswith("Write a Python ") for r in recs)
