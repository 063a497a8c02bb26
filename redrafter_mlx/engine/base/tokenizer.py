"""Tokenizers: LLaMA SentencePiece (``tokenizer.model``) directly, anything else through
mlx-lm's Hugging Face wrapper; chat prompts (Vicuna v1.1 or the tokenizer's own template,
with tools where it renders them); what the template marks in an answer (thinking, tool
calls: ``TemplateMarkers``, as mlx-lm infers them); and a streaming detokenizer that never
emits half a UTF-8 character.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .chat_format import vicuna_turns

_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD: what Python makes of bytes that
    are not UTF-8 (``surrogateescape`` in command-line arguments, piped stdin, file names) or
    a JSON ``"\\ud800"``. No tokenizer accepts them (SentencePiece raises, HF's may fail
    later); the replaced text reads as a decoder shows bad bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


@dataclass(frozen=True)
class TemplateMarkers:
    """What a chat template marks in an answer, as mlx-lm's tokenizer infers it
    (``mlx_lm.tokenizer_utils``: thinking from the vocabulary, the tool-call format from the
    template, else the vocabulary), so that an answer splits as mlx-lm's server splits it.

    think:      (start, end) text of a thinking block (``<think>``, ``</think>``), or None
    tool:       (start, end) text around a tool call (``<tool_call>``, ``</tool_call>``; the
                end is "" in a format without one, Mistral's ``[TOOL_CALLS]``), or None
    parse_tool: mlx-lm's parser of one call's text (``mlx_lm.tool_parsers.<format>``):
                ``parse_tool(text, tools) -> {"name", "arguments"} | [...]``; None: the
                template has no tool-call format mlx-lm knows
    ids:        the token ids of those markers, kept in decoded text where they are
                special tokens (``Tokenizer.decode``'s ``keep``)
    tool_ids:   the tool-call start's token ids (a prompt that opens a call ends with them)
    """

    think: tuple[str, str] | None = None
    tool: tuple[str, str] | None = None
    parse_tool: Callable | None = None
    ids: frozenset[int] = frozenset()
    tool_ids: tuple[int, ...] = ()


class Tokenizer:
    """encode/decode, special ids and chat prompts over one of two backends."""

    def __init__(self, path: Path):
        self.path = Path(path)
        config_file = self.path / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.chat_template = self.config.get("chat_template") or _template_file(self.path)
        if (self.path / "tokenizer.model").exists() and not self.chat_template:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_file=str(self.path / "tokenizer.model"))
            self._hf = None
            self.bos_token_id = self._sp.bos_id()
            self.eos_token_ids = {self._sp.eos_id(), *_config_eos_ids(self.path)}
            self.vocab_size = self._sp.get_piece_size()
        else:
            from mlx_lm.utils import load_tokenizer as _load

            self._sp = None
            self._hf = _load(self.path, eos_token_ids=_config_eos_ids(self.path) or None)
            self.bos_token_id = self._hf.bos_token_id
            self.eos_token_ids = set(self._hf.eos_token_ids)
            self.vocab_size = len(self._hf.get_vocab())

    def id_tokens(self) -> list[str | None]:
        """Each id's token string, in id order (None for an id the vocabulary skips): the
        whole vocabulary, which two tokenizers must share for one model to draft another's
        ids (``loading.check_same_tokenizer``)."""
        if self._sp is not None:
            return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        vocab = self._hf.get_vocab()
        tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            tokens[i] = token
        return tokens

    @property
    def eos_token_id(self) -> int:
        return min(self.eos_token_ids)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of ``text`` (BOS first when ``add_bos``); bytes that were not UTF-8
        read as U+FFFD (:func:`valid_text`). ``special=False``: text spelling a special token
        (``<|im_end|>``) is encoded as the plain text it is, never as that token (what a user
        typed into a message); SentencePiece never reads special tokens from text."""
        text = valid_text(text)
        if self._sp is not None:
            ids = self._sp.encode(text)
            return ([self.bos_token_id] if add_bos else []) + ids
        return self._hf.encode(text, add_special_tokens=add_bos, split_special_tokens=not special)

    def decode(self, ids, keep: frozenset[int] = frozenset()) -> str:
        """The text of ``ids``, special tokens left out except those in ``keep`` (a
        template's markers, ``TemplateMarkers.ids``; all of them: ``special_ids``)."""
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        if not keep:
            return self._hf.decode(ids, skip_special_tokens=True)
        ids = [i for i in ids if i in keep or i not in self.special_ids]
        return self._hf.decode(ids, skip_special_tokens=False)

    def piece(self, token_id: int) -> str | None:
        """The vocabulary's spelling of ``token_id``: a SentencePiece piece (``▁word``,
        ``<0xE2>``), a BPE token (byte-level: ``byte_level``); None for an unknown id."""
        if self._sp is not None:
            return self._sp.id_to_piece(int(token_id))
        return self._hf.convert_ids_to_tokens(int(token_id))

    @cached_property
    def byte_level(self) -> bool:
        """Whether the tokens spell bytes in GPT-2's alphabet (byte-level BPE: ``Ġ`` a space)."""
        return self._hf is not None and any("\u0120" in t for t in self._hf.get_vocab())

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids ``decode`` leaves out: added tokens flagged special (none for
        SentencePiece, whose decoder drops its control pieces itself)."""
        if self._hf is None:
            return frozenset()
        added = self._hf.added_tokens_decoder
        return frozenset(i for i, token in added.items() if token.special)

    @cached_property
    def markers(self) -> TemplateMarkers:
        """The chat template's markers (none for SentencePiece or no template)."""
        hf = self._hf
        if hf is None or not self.chat_template:
            return TemplateMarkers()
        think = (hf.think_start, hf.think_end) if hf.has_thinking else None
        tool = (hf.tool_call_start, hf.tool_call_end) if hf.has_tool_calling else None
        ids = (hf.think_start_tokens or ()) + (hf.think_end_tokens or ())
        ids += (hf.tool_call_start_tokens or ()) + (hf.tool_call_end_tokens or ())
        tool_ids = tuple(hf.tool_call_start_tokens or ())
        return TemplateMarkers(think, tool, hf.tool_parser, frozenset(ids), tool_ids)

    def thinking_open(self, prompt: list[int]) -> bool:
        """Whether ``prompt`` ends inside a thinking block (its template opened one for the
        answer: the answer starts as reasoning), by mlx-lm's server's rule: the last think
        start comes after the last think end."""
        if self.markers.think is None:
            return False
        return self._hf.rfind_think_start(prompt) > self._hf.rfind_think_end(prompt)

    def chat_prompt(
        self, messages: list[dict], system: str | None = None, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a conversation ending with an open assistant turn.

        messages: [{"role": "user"|"assistant", "content": str}, ...]; with a template, also
        assistant ``tool_calls`` and ``tool`` results, which it renders as it renders
        ``tools`` (OpenAI's function specs, given to ``apply_chat_template(tools=)``). The
        tokenizer's chat template is used when it has one; otherwise Vicuna v1.1
        (docs/design/formats.md, "Chat formats"), which renders no tools.
        Text that was not UTF-8 reads as U+FFFD (:func:`valid_text`). The messages' text is
        plain text: a ``<|im_end|>`` or ``</s>`` typed in it never becomes the control token
        (a user cannot fake a turn boundary); only the format's own markers are.
        """
        messages = [_valid_message(m) for m in messages]
        system = None if system is None else valid_text(system)
        if self.chat_template and self._hf is not None:
            msgs = ([{"role": "system", "content": system}] if system else []) + messages
            return self._template_ids(msgs, tools or None)
        if tools or any(m["role"] not in ("user", "assistant") for m in messages):
            raise ValueError("the Vicuna format renders no tools; this tokenizer has no template")
        ids = [self.bos_token_id]
        for i, part in enumerate(vicuna_turns(messages, system)):
            if i:
                ids.append(self.eos_token_id)  # the end of an assistant reply
            if part:
                ids.extend(self.encode(part, add_bos=False, special=False))
        return ids

    def _template_ids(self, msgs: list[dict], tools: list[dict] | None) -> list[int]:
        """The chat template's ids, each message's text encoded as plain text.

        Messages without special-token text: the template's own ids (exactly as
        ``apply_chat_template`` gives them). Otherwise the template is rendered around
        markers, its text encoded with its special tokens and each message's text without.
        """
        specials = [t for t in self._hf.all_special_tokens if t]
        texts = [m.get("content") for m in msgs]
        if not any(isinstance(c, str) and any(t in c for t in specials) for c in texts):
            return list(self._hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True))
        marked = [
            {**m, "content": _marker(i)} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(msgs)
        ]
        text = self._hf.apply_chat_template(
            marked, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = []
        for i, part in enumerate(_MARKER.split(text)):
            if i % 2:  # a message's text
                ids += self.encode(msgs[int(part)]["content"], add_bos=False, special=False)
            elif part:  # the template's text, its special tokens parsed
                ids += self.encode(part, add_bos=False)
        return ids


_MARKER = re.compile("\ue000(\\d+)\ue001")  # private-use characters: no template alters them


def _marker(i: int) -> str:
    return f"\ue000{i}\ue001"


def _valid_message(message: dict) -> dict:
    """A chat message whose string content is :func:`valid_text`."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    return {**message, "content": valid_text(content)}


def _template_file(path: Path) -> str | None:
    """``chat_template.jinja`` beside tokenizer_config.json (where current transformers saves "
    "it)."""
    file = path / "chat_template.jinja"
    return file.read_text() if file.is_file() else None


def _config_eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` (an int or a list: end of text and end of turn) of config.json and
    generation_config.json, so generation stops at either."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = path / name
        value = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
        ids += [value] if isinstance(value, int) else [i for i in value or [] if isinstance(i, int)]
    return list(dict.fromkeys(ids))


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer(Path(path))


class StreamDecoder:
    """Incremental text for a growing token list, holding back incomplete characters;
    ``keep``: the special tokens its text shows (``Tokenizer.decode``)."""

    def __init__(self, tokenizer: Tokenizer, keep: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.keep = keep
        self.tokens: list[int] = []
        self.emitted = ""

    def text_of(self, ids) -> str:
        """``ids`` decoded as this stream decodes them."""
        if self.keep:
            return self.tokenizer.decode(ids, keep=self.keep)
        return self.tokenizer.decode(ids)

    def add(self, tokens) -> str:
        """Append token ids; return the newly completed text."""
        self.tokens.extend(int(t) for t in tokens)
        text = self.text_of(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new

    def flush(self) -> str:
        text = self.text_of(self.tokens)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new
