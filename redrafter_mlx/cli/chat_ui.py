"""The interactive chat loop behind ``redrafter-mlx chat``.

One :class:`ChatLoop` holds the conversation and one engine ``Session``, so each turn
prefills only the tokens its prompt adds to what the KV cache already holds. When the
history plus ``max_tokens`` would not fit the model's context, the oldest turns are
dropped (the cache prefix then changes and ``Session.reuse`` re-prefills from there).
Ctrl-C during an answer stops that answer, keeps what was said, and returns to the prompt.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.text import Text

from redrafter_mlx.cli.terminal import visible

HELP = (
    "/reset  clear the conversation · /stats  details of the last answer · "
    "/system <text>  set the system prompt (/system alone shows it) · "
    "/quit  leave (or Ctrl-D) · Ctrl-C stops an answer · "
    "//text  sends /text (a message that begins with /)\n"
    "The line after an answer: tokens, tok/s, tok/step (tokens per verify step), and "
    "'steps emitting 1/2/3/4 tokens: a/b/c/d': how many steps emitted 1 token (no draft "
    "accepted), 2 tokens (one drafted token accepted + the model's own), and so on. "
    "With branches (APAR): the answer's tokens (the rebuilt text's) and their tok/s, the "
    "branches, the sequential steps (with the answer's tokens per step); 'branch steps "
    "emitting ...' counts each branch's own steps."
)
DRAFTED_STYLE = "green"


def accepted_chunk(decoder, tokens: Sequence[int], drafted: Sequence[bool], flush: bool) -> Text:
    """``tokens`` as text (through ``decoder``, a ``StreamDecoder``; ``flush``: the answer
    ends here) with those accepted from drafts (their ``drafted`` mark) in DRAFTED_STYLE:
    each run of tokens with one mark is one span (``--show-accepted``; a linear step's
    drafts come first, an APAR answer's marks come from the branches that wrote them)."""
    marks = [*drafted, *[False] * (len(tokens) - len(drafted))]
    chunk = Text()
    for mark, run in itertools.groupby(zip(tokens, marks), key=lambda pair: pair[1]):
        text = decoder.add([token for token, _ in run])
        chunk.append(visible(text), style=DRAFTED_STYLE if mark else None)
    if flush:
        chunk.append(visible(decoder.flush()))
    return chunk


def read_line(prompt: str = ">> ") -> str | None:
    """One line of user input, or None at end of input (Ctrl-D or the end of a pipe).

    The prompt string is shown only on a terminal, so piped transcripts stay clean. Bytes
    that are not UTF-8 do not end the chat (:func:`tolerant_stdin`).
    """
    tolerant_stdin()
    try:
        return input(prompt if sys.stdin.isatty() else "")
    except EOFError:
        return None


def tolerant_stdin() -> None:
    """Let stdin read bytes that are not UTF-8 as lone surrogates (Python's
    ``surrogateescape``, already its way in a C/POSIX locale) instead of raising
    UnicodeDecodeError; the tokenizer reads them as U+FFFD (``engine/tokenizer.valid_text``)."""
    stdin = sys.stdin
    if getattr(stdin, "errors", None) == "strict" and hasattr(stdin, "reconfigure"):
        with contextlib.suppress(ValueError, OSError):
            stdin.reconfigure(errors="surrogateescape")


def enable_line_editing() -> None:
    """On a terminal, give ``input()`` arrow keys and history (GNU readline, if present)."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 (importing it is what enables editing)


def settle_compiler_check() -> None:
    """Run MLX's one-time compiler check now, before the first prompt.

    The first compiled kernel MLX's CPU backend runs in a process checks for a C++ compiler
    with ``system("g++ --version")``, and ``system`` ignores SIGINT while its child runs
    (measured with strace: ~20 ms on an idle machine, longer when loaded), so a Ctrl-C in that
    window of the first answer was lost. A tiny compiled function here takes the check at
    start-up. (A kernel not yet in MLX's on-disk cache is built the same way, ~1.5 s; that
    happens once per machine and MLX version.)
    """
    import mlx.core as mx

    mx.eval(mx.compile(_twice_plus_one)(mx.zeros((1,))))


def _twice_plus_one(x):
    return x * 2 + 1


class ChatLoop:
    """A multi-turn conversation with KV-cache reuse through one ``Session``."""

    def __init__(
        self,
        engine,
        plan,
        sampling,
        max_tokens: int,
        system: str | None = None,
        show_accepted: bool = False,
        console: Console | None = None,
    ):
        from redrafter_mlx.engine.decoding.cache import Session
        from redrafter_mlx.engine.loop.generation import stream_generate

        self.engine = engine
        self.plan = plan
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.system = system
        self.show_accepted = show_accepted
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.messages: list[dict] = []
        self.session = Session(engine.model)
        self.stream = stream_generate  # replaceable (tests inject interruptions)
        self.adapt = True  # switch beam shapes by measured tokens/s (chat --no-adapt: False)
        self.branches = "auto"  # APAR branches (chat --branches): the answer is rebuilt text
        self.last = None  # the last answer's final GenerationResponse
        self.answer_tokens = 0  # its text's tokens (with branches: the rebuilt text's)
        self.dropped_turns = 0

    # ------------------------------------------------------------------ prompt and context

    def prompt_ids(self, messages: list[dict] | None = None) -> list[int]:
        """``messages`` (default: the conversation) in the chat format, ending with an open
        assistant turn."""
        messages = self.messages if messages is None else messages
        return self.engine.tokenizer.chat_prompt(messages, system=self.system)

    def fit_context(self, messages: list[dict]) -> tuple[list[dict], list[int], int]:
        """Which of ``messages`` fit: the oldest turns are left out until their prompt plus
        max_tokens fits the context. Returns (the messages kept, their prompt ids, the turns
        left out); ``messages`` itself is not changed, so a turn that then fails leaves the
        conversation as it was.

        The newest user message is always kept; if it alone is too long the engine reports it.
        """
        context = self.engine.model.max_context
        kept = list(messages)
        ids = self.prompt_ids(kept)
        dropped = 0
        while context is not None and len(ids) + self.max_tokens > context and len(kept) > 1:
            turn = 2 if kept[1]["role"] == "assistant" else 1
            del kept[:turn]
            dropped += 1
            ids = self.prompt_ids(kept)
        return kept, ids, dropped

    # ------------------------------------------------------------------ one answer

    def answer(self, user_text: str) -> str:
        """Stream the assistant's answer to ``user_text``; return the text kept in history.

        The conversation changes only once the turn has an answer: a turn that fails (the
        message alone exceeds the context, or anything else) prints one error line, and
        Ctrl-C before any text (while the message is tokenised and fitted, or before the
        first token) cancels the turn; either way the conversation, dropped turns included,
        stays as it was before the message.
        """
        from redrafter_mlx.cli.common import check_prompt_fits, context_limit

        asked = [*self.messages, {"role": "user", "content": user_text}]
        text, interrupted = "", False
        try:
            kept, ids, dropped = self.fit_context(asked)
            check_prompt_fits(self.engine.model, len(ids))
            text, interrupted = self.stream_answer(ids)
        except KeyboardInterrupt:  # while preparing the turn: nothing was said
            text, interrupted = "", True
        except Exception as e:
            self.error(e, unchanged=True)
            return ""
        finally:
            self.repair_session()
        if interrupted:
            self.note("[interrupted]" if text else "[interrupted; the conversation is unchanged]")
        if text or not interrupted:
            self.messages = [*kept, {"role": "assistant", "content": text}]
            self.dropped_turns += dropped
            if dropped:  # said once it has happened: a refused turn drops nothing
                limit = context_limit(self.engine.model)
                self.note(f"[dropped the oldest {dropped} turn(s) to fit {limit}]")
        if self.last is not None:
            from redrafter_mlx.cli.stats import stats_line

            self.note(stats_line(self.last, self.plan, self.answer_tokens))
        return text

    def stream_answer(self, ids: list[int]) -> tuple[str, bool]:
        """Print the answer as steps are accepted; return (text, interrupted by Ctrl-C).

        An answer whose APAR branches run side by side (responses with ``branch_pieces``)
        shows, on a terminal, a live view of the branches growing (``cli.branch_view``) that
        gives way to the final text, printed once as a normal answer; off a terminal, only
        that text. Ctrl-C keeps the text that was final."""
        from redrafter_mlx.engine.base.tokenizer import StreamDecoder

        e = self.engine
        decoder = StreamDecoder(e.tokenizer)
        text, tokens = "", 0  # the last answer's stats stay until this one has a response
        accepted = StreamDecoder(e.tokenizer) if self.show_accepted else None
        branching = BranchAnswer(self.console, e.tokenizer.decode, accepted)
        draft = getattr(e, "draft_model", None)
        stream = self.stream(
            e.model,
            e.drafter,
            e.tokenizer,
            ids,
            max_tokens=self.max_tokens,
            session=self.session,
            shape=self.plan.shape,
            sampler=self.sampling,
            adapt=self.adapt,
            **({"draft_model": draft} if draft is not None else {}),
            branches=self.branches,
        )
        try:
            for response in stream:
                text += response.text
                tokens += len(response.tokens)
                self.last, self.answer_tokens = response, tokens
                if not branching.take(response):
                    self.show(response, decoder)
        except KeyboardInterrupt:
            return text, True
        finally:
            branching.close(text)  # the live view gives way to the final text
            stream.close()  # hands the KV cache back to the session
            self.console.print()
        return text, False

    def show(self, response, decoder) -> None:
        """Print one streamed chunk (control characters shown visibly: ``terminal.visible``);
        with --show-accepted, tokens accepted from drafts are coloured."""
        if not self.show_accepted:
            self.console.print(visible(response.text), end="", markup=False, emoji=False)
            return
        done = bool(response.finish_reason)
        chunk = accepted_chunk(decoder, response.tokens, response.drafted_tokens, done)
        self.console.print(chunk, end="")

    def repair_session(self) -> None:
        """After an interruption at an unlucky moment the session may have lost its cache."""
        if self.session.cache is None:
            from redrafter_mlx.engine.decoding.cache import Session

            self.session = Session(self.engine.model)

    # ------------------------------------------------------------------ commands

    def command(self, line: str) -> bool:
        """Run an in-chat ``/command``; return False when the user wants to leave."""
        name, _, arg = line.strip().partition(" ")
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/reset":
            self.reset()
        elif name == "/stats":
            self.console.print(self.stats_text(), markup=False, emoji=False)
        elif name == "/system":
            self.set_system(arg.strip())
        elif name == "/help":
            self.note(HELP)
        else:
            self.note(f"unknown command {name}; {HELP}")
        return True

    def reset(self) -> None:
        """Forget the conversation, the KV cache and the dropped-turns count."""
        self.messages.clear()
        self.session.reset()
        self.last, self.answer_tokens = None, 0
        self.dropped_turns = 0
        self.note("[conversation cleared]")

    def set_system(self, text: str) -> None:
        """Set the system prompt (the next turn re-prefills from where the prompt changes)."""
        if not text:
            from redrafter_mlx.engine.base.chat_format import VICUNA_SYSTEM

            current = self.system if self.system is not None else f"(default) {VICUNA_SYSTEM}"
            self.note(f"system prompt: {visible(current)}")
            return
        problem = self.system_problem(text)
        if problem is not None:
            message = f"error: /system: {problem} (the system prompt is unchanged)"
            self.console.print(Text(message, style="bold red"))
            return
        self.system = text
        self.note("[system prompt set; the conversation is kept]")

    def system_problem(self, system: str) -> str | None:
        """Why ``system`` cannot be the system prompt (it leaves no room in the context for
        a message and an answer, so every turn would fail), or None when it fits."""
        context = self.engine.model.max_context
        if context is None:
            return None
        from redrafter_mlx.cli.common import context_limit

        empty_turn = [{"role": "user", "content": ""}]
        used = len(self.engine.tokenizer.chat_prompt(empty_turn, system=system))
        if context - used >= 2:
            return None
        return (
            f"the system prompt takes {used:,} tokens in the chat format, leaving no room for "
            f"a message and an answer in {context_limit(self.engine.model)}; shorten it"
        )

    def stats_text(self) -> str:
        """Details of the last answer and the cache (the ``/stats`` command)."""
        from redrafter_mlx.cli.stats import format_hist

        lines = [
            f"beam: {self.plan.label} ({self.plan.source})",
            f"history: {len(self.messages)} messages, {len(self.session.cached[0])} tokens "
            f"cached, {self.dropped_turns} turn(s) dropped for context",
        ]
        r = self.last
        if r is None:
            return "\n".join(lines + ["no answer yet"])
        from redrafter_mlx.cli.stats import answer_branch_stats, rate_text

        branched = answer_branch_stats(r, self.answer_tokens)
        if branched is None:
            answer = f"answer: {r.generation_tokens} tokens, {rate_text(r)}"
        else:  # the rebuilt text's tokens, then all the branches decoded
            answer = (
                f"answer: {branched['answer_tokens']} tokens, {branched['answer_tps']:.1f} "
                f"tok/s ({r.generation_tokens} decoded in {r.branches} branches)"
            )
        lines += [
            f"prompt: {r.prompt_tokens} tokens, {r.prefilled_tokens} prefilled "
            f"({r.prompt_tokens - r.prefilled_tokens} reused from the cache), "
            f"{r.prompt_tps:.0f} tok/s",
            f"{answer}, time to first token {r.time_to_first_token * 1e3:.0f} ms, "
            f"finish {r.finish_reason or 'interrupted'}",
        ]
        if self.plan.speculative:
            per_step = "step" if branched is None else "branch step"
            lines.append(
                f"steps: {r.steps}, {r.tokens_per_step:.2f} tokens/{per_step}, "
                f"{self.packed_text(r)}, host {r.host_ms_per_step:.2f} ms/step, "
                f"{format_hist(r.accept_hist, per_step + 's')}"
            )
        lines.append(f"peak memory: {r.peak_memory_gb:.3f} GB")
        return "\n".join(lines)

    def packed_text(self, r) -> str:
        """Tokens the verifier scored per step, against the slots of the shape that packs them
        (``BeamShape.slots``: beams and lookup chains, or the capacity). With adaptive shapes
        the steps ran shapes of their own (longer chains, say), so the asked shape's slots are
        a reference, not a bound."""
        slots, label = self.plan.shape.slots, self.plan.label
        if self.adapt:
            return f"mean packed {r.mean_packed:.1f} tokens (adaptive; {label} packs {slots})"
        return f"mean packed {r.mean_packed:.1f} of {slots} slots"

    def note(self, message: str) -> None:
        """A dim status line."""
        self.console.print(Text(message, style="dim"))

    def error(self, e: Exception, unchanged: bool = False) -> None:
        """One red line for a turn or command that failed; the chat goes on. ``unchanged``:
        say that the conversation is as it was (a failed turn)."""
        what = str(e) if isinstance(e, ValueError) else f"unexpected {type(e).__name__}: {e}"
        tail = " (the conversation is unchanged)" if unchanged else ""
        self.console.print(Text(f"error: {what}{tail}", style="bold red"))


class BranchAnswer:
    """One answer's branch display: inactive until a response carries ``branch_pieces``
    (branching on); then, on a terminal, a ``rich.live.Live`` of :class:`BranchView`
    (transient: it leaves nothing behind), and at the end the final text printed once.
    ``accepted``: a ``StreamDecoder`` with ``--show-accepted`` (None: without): the final
    text, live and settled, then colours the tokens accepted from drafts, each branch's
    marks carried through the rebuild (:func:`accepted_chunk`)."""

    def __init__(self, console: Console, decode, accepted=None):
        self.console = console
        self.decode = decode
        self.accepted = accepted
        self.view = None
        self.live = None

    def take(self, response) -> bool:
        """Show ``response`` if the answer branches (True), else leave it to the caller."""
        from redrafter_mlx.cli.branch_view import BranchView, render_branches

        if self.view is None:
            if not response.branch_pieces:
                return False
            self.view = BranchView(self.decode, marked=None if self.accepted is None else Text())
            if self.console.is_terminal:
                from rich.live import Live

                self.live = Live(console=self.console, transient=True, auto_refresh=False)
                self.live.start()
        self.view.update(response)
        if self.accepted is not None:
            done = bool(response.finish_reason)
            chunk = accepted_chunk(self.accepted, response.tokens, response.drafted_tokens, done)
            self.view.marked.append_text(chunk)
        if self.live is not None:
            size = self.console.size
            self.live.update(render_branches(self.view, size.width, size.height), refresh=True)
        return True

    def close(self, text: str) -> None:
        """End the live view and print ``text`` (the answer's final text) as an answer
        (with ``accepted``: the same text, its accepted drafts coloured)."""
        if self.live is not None:
            self.live.stop()
        if self.view is not None and self.view.marked is not None:
            self.console.print(self.view.marked, end="")
        elif self.view is not None:
            self.console.print(visible(text), end="", markup=False, emoji=False)


def run_chat(loop: ChatLoop, read: Callable[[str], str | None] = read_line) -> None:
    """Read messages until /quit or end of input. Ctrl-C at the prompt only clears the line;
    anywhere in a turn or a command it ends that turn or command, never the chat."""
    while True:
        try:
            line = read(">> ")
        except KeyboardInterrupt:
            loop.console.print()
            loop.note("(Ctrl-D or /quit leaves)")
            continue
        if line is None:
            loop.console.print()
            return
        if not line.strip():
            continue
        try:
            if line.startswith("//"):  # the escape: "//text" sends "/text"
                loop.answer(line[1:])
            elif line.startswith("/"):
                if not run_command(loop, line):
                    return
            else:
                loop.answer(line)
        except KeyboardInterrupt:  # past the turn's own handling (e.g. printing its stats)
            loop.console.print()
            loop.note("[interrupted]")


def run_command(loop: ChatLoop, line: str) -> bool:
    """``loop.command(line)``; a command that fails prints one error line and the chat goes
    on (returns True)."""
    try:
        return loop.command(line)
    except Exception as e:
        loop.error(e)
        return True
