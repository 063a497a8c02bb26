"""The tokenizer a GGUF file describes in its metadata -> ``tokenizer.json`` + config files.

Two vocabularies are supported, rebuilt with the ``tokenizers`` library the way transformers'
GGUF loader builds them (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), so token ids
match it:

- byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen-style), and
- SentencePiece BPE (``"llama"``: Llama 1/2, Vicuna, TinyLlama, Mistral): byte fallback,
  ``▁`` for spaces, merges from the file or recovered from the token scores.

End of turn: GGUF metadata often names a document EOS (``<|endoftext|>``) while chat turns end
with another token (``<|im_end|>``). The chat template is rendered in a sandbox (no code runs)
on a two-message conversation, and the special token that closes the assistant's message is
added to the EOS ids, so generation stops at the end of a turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from weights_convert.errors import ConversionError

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token_type values
# tokenizer.ggml.pre -> split regex (transformers' table for the families we expect in
# llama-architecture files). Other values keep GPT-2's split, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Qwen2TokenizerFast's: digits one by one
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **{name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")},
    "qwen2": _QWEN2_SPLIT,
}
_USER, _ASSISTANT = "\x00user-text\x00", "\x00assistant-text\x00"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_strings(metadata: dict) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConversionError("the GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer")
    return tokens


def _token_types(metadata: dict, count: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    return [int(t) for t in types] if types is not None and len(types) == count else [1] * count


def special_token_ids(metadata: dict) -> list[int]:
    """Ids of control tokens (``<|im_end|>``, ``<|endoftext|>``, ...)."""
    tokens = _token_strings(metadata)
    return [i for i, t in enumerate(_token_types(metadata, len(tokens))) if t == TOKEN_CONTROL]


def _byte_level_backend(metadata: dict):
    """A ``tokenizers.Tokenizer`` for a GPT-2-style vocabulary, as transformers builds it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = _token_strings(metadata)
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in metadata.get("tokenizer.ggml.merges", [])]
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), "isolated"), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, metadata, spelled)
    return backend


def _merges_from_scores(tokens: list[str], scores) -> list[tuple[str, str]]:
    """SentencePiece merges implied by the vocabulary: every split of a token into two tokens,
    best score first (``transformers.tokenization_utils_base.generate_merges``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merge, score in dict(zip(tokens, (float(x) for x in scores))).items():
        local = [(merge[:k], merge[k:], score) for k in range(1, len(merge))]
        local = [m for m in local if m[0] in vocab and m[1] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(metadata: dict):
    """A ``tokenizers.Tokenizer`` for a SentencePiece BPE vocabulary, as transformers'
    ``LlamaTokenizer`` builds it from GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = _token_strings(metadata)
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ConversionError(
                "the GGUF file's SentencePiece vocabulary has no scores or merges"
            )
        merges = _merges_from_scores(tokens, scores)
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True)
    backend = Tokenizer(model)
    # Llama prepends a space to the text; Gemma (add_space_prefix false) does not.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + ([decoders.Strip(content=" ", left=1)] if prefix else [])
    )
    _add_special_tokens(backend, metadata, None)
    return backend


def _add_special_tokens(backend, metadata: dict, alphabet: set[str] | None) -> None:
    """Control tokens as special tokens (byte-level: only those spelled in its alphabet, as
    transformers does), user-defined tokens as plain added tokens."""
    from tokenizers import AddedToken

    tokens = _token_strings(metadata)
    types = _token_types(metadata, len(tokens))
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types)
            if kind == TOKEN_CONTROL and (alphabet is None or set(t) <= alphabet)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types)
            if kind == TOKEN_USER_DEFINED
        ]
    )


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
):
    """BOS/EOS insertion as transformers sets it from ``add_bos_token``/``add_eos_token``."""
    from tokenizers import processors

    single, special = "$A:0", []
    if add_bos and bos is not None:
        single = f"{tokens[bos]}:0 {single}"
        special.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single = f"{single} {tokens[eos]}:0"
        special.append((tokens[eos], eos))
    pair = f"{single} {single.replace('$A', '$B').replace(':0', ':1')}"
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(special))
    )


_BACKENDS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def check_tokenizer(metadata: dict, name: str) -> None:
    """Refuse vocabularies we cannot rebuild exactly."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _BACKENDS:
        raise ConversionError(
            f"{name} carries a {kind!r} tokenizer; only byte-level BPE ('gpt2') and SentencePiece "
            "BPE ('llama') GGUF tokenizers are supported; convert the original Hugging Face "
            "checkpoint instead"
        )
    _token_strings(metadata)


def _render_sandboxed(template: str, messages: list[dict], tokens: dict[str, str]) -> str:
    """Render a chat template in jinja2's immutable sandbox (as transformers does)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=False, **tokens
    )


def end_of_turn_id(metadata: dict) -> int | None:
    """The special token that closes an assistant message in the chat template, or None.

    Renders ``[user, assistant]`` and looks at what follows the assistant's text: the longest
    control token it starts with (after whitespace). Any template error gives None.
    """
    template = metadata.get("tokenizer.chat_template")
    if not isinstance(template, str):
        return None
    tokens = _token_strings(metadata)
    names = {
        f"{key}_token": tokens[i]
        for key in ("bos", "eos")
        if isinstance(i := metadata.get(f"tokenizer.ggml.{key}_token_id"), int)
        and 0 <= i < len(tokens)
    }
    messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    try:
        text = _render_sandboxed(template, messages, names)
    except Exception:
        return None
    if _ASSISTANT not in text:
        return None
    after = text.split(_ASSISTANT, 1)[1].lstrip()
    matches = [i for i in special_token_ids(metadata) if tokens[i] and after.startswith(tokens[i])]
    return max(matches, key=lambda i: len(tokens[i])) if matches else None


def eos_token_ids(metadata: dict) -> list[int]:
    """The metadata EOS, then llama.cpp's end-of-turn/-message ids and the chat template's
    end-of-turn token, each once."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [metadata.get(f"tokenizer.ggml.{key}") for key in keys] + [end_of_turn_id(metadata)]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _token_name(metadata: dict, key: str) -> str | None:
    tokens = _token_strings(metadata)
    i = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def write_tokenizer(metadata: dict, eos_ids: list[int], out_dir: Path) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json -> names written."""
    tokens = _token_strings(metadata)
    kind = metadata.get("tokenizer.ggml.model")
    backend = _BACKENDS[kind](metadata)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = (
        metadata.get("tokenizer.ggml.bos_token_id"),
        metadata.get("tokenizer.ggml.eos_token_id"),
    )
    backend.post_processor = _post_processor(tokens, bos, eos, add_bos, add_eos)
    backend.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_name(metadata, "bos"),
        "eos_token": _token_name(metadata, "eos"),
        "unk_token": _token_name(metadata, "unknown"),
        "pad_token": _token_name(metadata, "padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get("llama.context_length", 4096)),
    }
    if isinstance(metadata.get("tokenizer.chat_template"), str):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    _write_json(out_dir / "tokenizer_config.json", config)
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids}
    _write_json(
        out_dir / "generation_config.json", {k: v for k, v in generation.items() if v is not None}
    )
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=4, ensure_ascii=False)
        f.write("\n")
