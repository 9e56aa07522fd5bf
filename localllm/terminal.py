"""Model text on a terminal: shown, never obeyed.

A reply is whatever the model (or a crafted conversation, a fine-tune, a hostile chat template)
makes it, and a terminal acts on the control characters in it: `ESC [ 31 m` recolours everything
after it, `ESC ] 0 ; TEXT BEL` retitles the window, CR and backspace overwrite what was shown, some
terminals answer queries by typing into the prompt. So text bound for a terminal keeps newlines and
tabs and shows every other control character the way `cat -v` does: ESC as `^[`, BEL as `^G`, CR as
`^M`, DEL as `^?`, the C1 controls U+0080-U+009F (CSI is U+009B) as `M-^[` and so on. An escape
sequence then reads as text (`^[[31m`) and does nothing.

The mapping is per character, so a sequence split across streamed deltas (ESC at the end of one
token, `[31m` in the next) comes out the same as if it had arrived whole: no state to carry.
"""

from __future__ import annotations

from typing import TextIO

_KEEP = ("\n", "\t")


def _caret(code: int) -> str:
    if code == 0x7F:
        return "^?"
    if code >= 0x80:  # C1: cat -v's meta notation of the byte it was
        return "M-" + _caret(code - 0x80)
    return "^" + chr(code + 0x40)


_TABLE = {c: _caret(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in _KEEP}


def escape_controls(text: str) -> str:
    """`text` with every control character but newline and tab made visible (^[, ^G, M-^[ ...)."""
    return text.translate(_TABLE)


def output_filter(stream: TextIO, raw: bool = False):
    """What model text written to `stream` goes through: `escape_controls` when it is a terminal,
    unchanged when it is a pipe or a file (the answer as data, byte for byte) or when `raw` (the
    user's --raw-output: they asked for the sequences to reach the terminal)."""
    isatty = getattr(stream, "isatty", None)
    if raw or not (callable(isatty) and isatty()):
        return _same
    return escape_controls


def _same(text: str) -> str:
    return text
