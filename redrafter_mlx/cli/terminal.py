"""Text from a model (or a prompt author) made safe to print on a terminal.

A model can be steered to emit escape bytes (a logit bias, a prompt that asks for them), and a
terminal obeys them: move the cursor, rewrite the screen, set the window title. Every writer
of model text to a terminal (the chat's live view, ``generate``'s plain output, the system
prompt ``/system`` shows) passes it through :func:`visible` first, which shows control
characters the way careful terminal programs do (``cat -v``, ``less``): C0 controls as caret
notation (ESC as ``^[``), DEL as ``^?``, C1 controls (U+0080-U+009F) as ``\\x9b``-style escapes.
Newline and tab pass through. ``--json`` output needs none of this: JSON escapes them itself.
"""

from __future__ import annotations

KEPT = "\n\t"


def _picture(code: int) -> str:
    if code < 0x20:
        return "^" + chr(code + 0x40)  # 0x1b -> ^[, 0x00 -> ^@
    if code == 0x7F:
        return "^?"
    return f"\\x{code:02x}"  # C1: 0x80-0x9f


_TABLE = {
    code: _picture(code)
    for code in (*range(0x20), 0x7F, *range(0x80, 0xA0))
    if chr(code) not in KEPT
}


def visible(text: str) -> str:
    """``text`` with every control character but newline and tab shown as printable text
    (``"\\x1b[2J"`` -> ``"^[[2J"``, ``"\\x9b"`` -> ``"\\\\x9b"``); other text unchanged."""
    return text.translate(_TABLE)
