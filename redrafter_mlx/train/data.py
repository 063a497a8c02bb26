"""Training data for drafter distillation: read files, render chats, mark the training tokens.

Accepted files (the format is chosen by the file name):

* ``.json``: ShareGPT, ``[{"conversations": [{"from": "human"|"gpt"|"system", "value": str}]}]``
  (``user``/``assistant`` and ``role``/``content`` are accepted too).
* ``.jsonl``: one record per line, each one of
  ``{"conversations": [...]}`` (as above), ``{"prompt": str, "response": str}``
  (``request``/``reply`` too), ``{"text": str}``; for evaluation also ``{"turns": [str, ...]}``
  (user turns only, the MT-Bench / demo held-out layout).
  A record may also carry exact token ids, ``{"prompt_ids": [int], "response_ids": [int]}``
  (the model's own rendered prompt and its answer, EOS included when it ended): they are used
  as they are, without rendering or re-tokenizing (``--targets self`` needs exact ids).
* ``.txt``: plain text, split into chunks at blank lines.

Conversations are rendered with the model's chat format (``Tokenizer.chat_prompt``: Vicuna v1.1
unless the tokenizer has a chat template), each reply followed by EOS. Only assistant tokens
(reply + its EOS) are training tokens; for ``text`` records and ``.txt`` chunks every token is.

A rendered ``Sequence`` holds ``tokens`` (N,) and ``train`` (N,) bool: ``train[i]`` says token i
is one the drafter should learn to predict, so position t (the LLM's hidden state after token t)
is a training position iff ``train[t + 1]``.

Errors name the file, the record (0-based index; line number for JSONL) and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..engine.base.errors import RedrafterError

USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}
SYSTEM_ROLES = {"system"}
TEXT_CHUNK_CHARS = 4000  # .txt files: paragraphs are grouped into chunks of about this size


class DataError(RedrafterError, ValueError):
    """A data file that cannot be used; the message names the file, the record and the problem."""


@dataclass
class Sequence:
    """One rendered example. tokens: (N,) ids; train: (N,) bool, token i is a training target."""

    tokens: list[int]
    train: list[bool]

    def positions(self) -> list[int]:
        """Training positions t (0 <= t < N-1) whose next token is a training token."""
        return [t for t in range(len(self.tokens) - 1) if self.train[t + 1]]


@dataclass
class Record:
    """One raw record of a data file: where it came from (for errors) and its fields."""

    file: Path
    index: int
    where: str  # "record 3" or "line 4"
    data: object

    def error(self, what: str) -> DataError:
        return DataError(f"{self.file}: {self.where}: {what}")


# ------------------------------------------------------------------------------------------
# reading files


def read_records(path: str | Path) -> list[Record]:
    """All records of one data file, by extension (.json, .jsonl, .txt)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(
            f"{path}: is a folder, not a data file; give a .json (ShareGPT), .jsonl or .txt file "
            "(repeat the option for several files)"
        )
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}): {e.reason}") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _json_records(path, text)
    if suffix == ".jsonl":
        return list(_jsonl_records(path, text))
    if suffix == ".txt":
        return [Record(path, i, f"chunk {i}", {"text": c}) for i, c in enumerate(text_chunks(text))]
    raise DataError(f"{path}: unknown data format {suffix!r}; use .json (ShareGPT), .jsonl or .txt")


def _json_records(path: Path, text: str) -> list[Record]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    if isinstance(data, dict) and "conversations" in data:
        data = [data]
    if not isinstance(data, list):
        raise DataError(
            f"{path}: expected a JSON list of records (ShareGPT layout), got {type(data).__name__}"
        )
    return [Record(path, i, f"record {i}", r) for i, r in enumerate(data)]


def _jsonl_records(path: Path, text: str) -> Iterator[Record]:
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: line {i + 1}: invalid JSON at column {e.colno}: {e.msg}"
            ) from None
        yield Record(path, i, f"line {i + 1}", data)


def text_chunks(text: str, chunk_chars: int = TEXT_CHUNK_CHARS) -> list[str]:
    """Split plain text at blank lines and group paragraphs into chunks of ~chunk_chars."""
    chunks, current = [], ""
    for para in text.replace("\r\n", "\n").split("\n\n"):
        if not para.strip():
            continue
        if current and len(current) + len(para) + 2 > chunk_chars:
            chunks.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        chunks.append(current)
    return chunks


# ------------------------------------------------------------------------------------------
# records -> messages


def record_messages(rec: Record, need_reply: bool = True) -> tuple[list[dict] | None, str | None]:
    """A record as (chat messages, system prompt) or (None, text) for plain-text records.

    Messages are ``[{"role": "user"|"assistant", "content": str}, ...]``.
    """
    data = rec.data
    if not isinstance(data, dict):
        raise rec.error(f"expected an object, got {type(data).__name__}")
    if "conversations" in data:
        return _conversation(rec, data["conversations"])
    prompt = _first_key(data, ("prompt", "request", "instruction"))
    response = _first_key(data, ("response", "reply", "output", "completion"))
    if prompt is not None or response is not None:
        if prompt is None or response is None:
            raise rec.error("needs both 'prompt' and 'response' (strings)")
        for name, value in (("prompt", prompt), ("response", response)):
            if not isinstance(value, str):
                raise rec.error(f"'{name}' must be a string, got {type(value).__name__}")
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": response},
        ], None
    if "turns" in data:
        turns = data["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns) or not turns:
            raise rec.error("'turns' must be a non-empty list of strings")
        if need_reply:
            raise rec.error(
                "'turns' holds user prompts only; training needs replies "
                "(use this file as --eval-data)"
            )
        return [{"role": "user", "content": turns[0]}], None
    if "text" in data:
        if not isinstance(data["text"], str):
            raise rec.error(f"'text' must be a string, got {type(data['text']).__name__}")
        return None, data["text"]
    raise rec.error(
        f"no usable fields (has {sorted(data)}); expected 'conversations', "
        f"'prompt'+'response' or 'text'"
    )


def _first_key(data: dict, names: tuple[str, ...]):
    for n in names:
        if n in data:
            return data[n]
    return None


def _conversation(rec: Record, turns) -> tuple[list[dict], str | None]:
    """ShareGPT turns -> alternating user/assistant messages (a leading reply is dropped)."""
    if not isinstance(turns, list):
        raise rec.error(f"'conversations' must be a list, got {type(turns).__name__}")
    system, messages = None, []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise rec.error(f"turn {j} must be an object, got {type(turn).__name__}")
        role = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        if role is None or value is None:
            raise rec.error(f"turn {j} needs 'from' and 'value' (has {sorted(turn)})")
        if not isinstance(value, str):
            raise rec.error(f"turn {j}: 'value' must be a string, got {type(value).__name__}")
        role = str(role).lower()
        if role in SYSTEM_ROLES:
            system = value
            continue
        if role in USER_ROLES:
            role = "user"
        elif role in ASSISTANT_ROLES:
            role = "assistant"
        else:
            raise rec.error(f"turn {j}: unknown role {turn.get('from', turn.get('role'))!r}")
        if not messages and role == "assistant":
            continue  # ShareGPT dumps sometimes start with the assistant; FastChat drops it
        if messages and messages[-1]["role"] == role:
            raise rec.error(f"turn {j}: two {role} turns in a row (roles must alternate)")
        messages.append({"role": role, "content": value})
    return messages, system


# ------------------------------------------------------------------------------------------
# rendering


def render_chat(tokenizer, messages: list[dict], system: str | None = None) -> Iterator[Sequence]:
    """Token ids + training mask of a conversation; reply tokens (and EOS) are training tokens.

    Each reply's context is exactly the prompt a chat engine builds (``tokenizer.chat_prompt``),
    so the drafter trains on the hidden states it will see. When a later prompt does not
    re-tokenize the earlier turns identically (some chat templates), the conversation is split
    there: the finished part is yielded and the new prompt starts a fresh sequence.
    """
    tokens: list[int] = []
    train: list[bool] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = list(tokenizer.chat_prompt(messages[:i], system=system))
        if prompt[: len(tokens)] != tokens:
            if any(train):
                yield Sequence(tokens, train)
            tokens, train = [], []
        new = prompt[len(tokens) :]
        reply = tokenizer.encode(m["content"], add_bos=False) + [tokenizer.eos_token_id]
        tokens = tokens + new + reply
        train = train + [False] * len(new) + [True] * len(reply)
    if any(train):
        yield Sequence(tokens, train)


def render_text(tokenizer, text: str) -> Sequence:
    """BOS + text; every token after BOS is a training token."""
    tokens = tokenizer.encode(text, add_bos=True)
    return Sequence(tokens, [False] + [True] * (len(tokens) - 1))


def windows(seq: Sequence, seq_len: int) -> Iterator[Sequence]:
    """Cut a sequence into consecutive windows of at most seq_len tokens with training positions."""
    for start in range(0, len(seq.tokens), seq_len):
        w = Sequence(seq.tokens[start : start + seq_len], seq.train[start : start + seq_len])
        if len(w.tokens) >= 2 and any(w.train[1:]):
            yield w


def record_ids(rec: Record) -> Sequence | None:
    """A record's exact token ids (``prompt_ids`` + ``response_ids``) as a Sequence whose
    response tokens are the training tokens; None when the record has no ids."""
    data = rec.data
    if not isinstance(data, dict) or "response_ids" not in data:
        return None
    prompt, response = data.get("prompt_ids"), data["response_ids"]
    for name, ids in (("prompt_ids", prompt), ("response_ids", response)):
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise rec.error(f"'{name}' must be a list of non-negative token ids")
    if not prompt:
        raise rec.error("'prompt_ids' must not be empty (the answer needs a context)")
    return Sequence(prompt + response, [False] * len(prompt) + [True] * len(response))


def load_training_data(files, tokenizer, seq_len: int) -> list[Sequence]:
    """All training sequences (windows of <= seq_len tokens) of the given files, in order."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    out: list[Sequence] = []
    for f in files:
        n_before = len(out)
        for rec in read_records(f):
            ids = record_ids(rec)
            if ids is not None:
                out.extend(windows(ids, seq_len))
                continue
            messages, extra = record_messages(rec, need_reply=True)
            if messages is None:
                rendered = [render_text(tokenizer, extra)]
            else:
                rendered = list(render_chat(tokenizer, messages, system=extra))
            for seq in rendered:
                out.extend(windows(seq, seq_len))
        if len(out) == n_before:
            raise DataError(f"{f}: no training tokens (no assistant replies or text found)")
    return out


def load_prompts(files, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Evaluation prompts: each record's first user turn as the chat engine renders it.

    Plain-text records give their first 64 tokens (a continuation prompt).
    """
    prompts: list[list[int]] = []
    for f in files:
        for rec in read_records(f):
            messages, extra = record_messages(rec, need_reply=False)
            if messages is None:
                prompts.append(tokenizer.encode(extra, add_bos=True)[:64])
            else:
                first = [m for m in messages if m["role"] == "user"][:1]
                if not first:
                    raise rec.error("has no user turn to use as a prompt")
                prompts.append(list(tokenizer.chat_prompt(first, system=extra)))
            if limit is not None and len(prompts) >= limit:
                return prompts
    return prompts


def files_digest(files) -> str:
    """sha256 over the names' contents, in order (the data part of the cache key)."""
    h = hashlib.sha256()
    for f in files:
        data = Path(f).read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
