"""README.md's examples, as a test reads them, and the check of a printed output against the
README's. Rules (the README follows them; tests/test_readme.py enforces them):

- Fenced blocks are ``` or ~~~ fences (a ~~~ block may hold ``` lines: it closes only on ~~~).
  The info string says what a block is: `bash` (every line is a command), `python` (the block is
  one program), `console` or none (a transcript: `$ ` lines are commands, the lines after one
  are what it prints), `text` (synopses, diagrams, notices: not run). Any other info string, or
  an untagged block without a `$ ` line, is an error: tag it.
- A command may continue over lines ending in `\\`; a trailing `# comment` (outside quotes) is
  not part of it. `# exit N` in that comment is the exit status it must have; otherwise it must
  exit 1 when what it prints starts with `Error:`, and 0 when not.
- A printed line is compared whole; `…` or `...` inside it stands for text left out (long ids),
  a line that is only `...` for any number of lines. A test names the parts that change from run
  to run (timings, rates, ids) with regular expressions: the text they match in the README's line
  becomes that expression.
- A lone `$` ends a transcript (the shell prompt back).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
RUN_LANGS = {"", "console", "bash", "python"}
SKIP_LANGS = {"text"}
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`\s]*)\s*$")


@dataclass(frozen=True)
class Example:
    kind: str  # "command" or "python"
    text: str  # the command as printed (continuation lines kept), or the program
    comment: str  # a command's trailing comment, without the '#'
    output: tuple[str, ...] | None  # the lines the README shows it printing; None: it shows none (```bash, ```python)
    block: int  # index of its fenced block in the README
    line: int  # 1-based line of the README where it starts

    @property
    def key(self) -> str:
        """How test_readme.py's table names it: a command on one line (continuations joined with
        a space), a program as `python: ` + its first line."""
        if self.kind == "python":
            return "python: " + self.text.splitlines()[0]
        return " ".join(part.rstrip("\\").strip() for part in self.text.splitlines())

    @property
    def exit_code(self) -> int:
        m = re.search(r"\bexit (\d+)", self.comment)
        if m:
            return int(m.group(1))
        return 1 if self.output and self.output[0].startswith("Error:") else 0


class ReadmeError(ValueError):
    pass


def split_comment(line: str) -> tuple[str, str]:
    """`cmd  # note` -> ("cmd", "note"); a '#' inside quotes or inside a word is not a comment."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(info string, line of the first content line, content lines) of every fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not (lines[j].startswith(fence[0] * len(fence)) and
                                      lines[j].strip() == fence[0] * len(lines[j].strip())):
            j += 1
        if j == len(lines):
            raise ReadmeError(f"README line {i + 1}: the {fence} block is never closed")
        blocks.append((lang, i + 2, lines[i + 1:j]))
        i = j + 1
    return blocks


def _commands(lines: list[str], first: int, block: int) -> list[Example]:
    """A ```bash block: every line a command; an indented `# ...` line continues the comment."""
    out: list[Example] = []
    i = 0
    while i < len(lines):
        if not lines[i].strip() or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        start, parts = i, [lines[i]]
        while parts[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        cmd, comment = split_comment(parts[-1])
        out.append(Example("command", "\n".join([*parts[:-1], cmd]), comment, None, block, first + start))
        i += 1
    return out


def _transcript(lines: list[str], first: int, block: int) -> list[Example]:
    out: list[Example] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            if lines[i].strip() == "$":  # the prompt back: the transcript ends
                break
            if out or lines[i].strip():
                raise ReadmeError(f"README line {first + i}: a transcript line outside any command's output")
            i += 1
            continue
        start, parts = i, [lines[i][2:]]
        while parts[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        cmd, comment = split_comment(parts[-1])
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ ") and lines[i].strip() != "$":
            shown.append(lines[i])
            i += 1
        while shown and not shown[-1].strip():
            shown.pop()
        out.append(Example("command", "\n".join([*parts[:-1], cmd]), comment, tuple(shown), block, first + start))
    return out


def parse(text: str) -> list[Example]:
    examples: list[Example] = []
    for block, (lang, first, lines) in enumerate(fenced_blocks(text)):
        if lang in SKIP_LANGS:
            continue
        if lang not in RUN_LANGS:
            raise ReadmeError(f"README line {first - 1}: unknown block type ```{lang} (use bash, python, console "
                              "or text)")
        if lang == "python":
            examples.append(Example("python", "\n".join(lines) + "\n", "", None, block, first))
        elif lang == "bash":
            examples.extend(_commands(lines, first, block))
        elif not any(line.startswith("$ ") for line in lines):
            raise ReadmeError(f"README line {first - 1}: an untagged block without `$ ` commands: tag it ```text "
                              "if it is not an example")
        else:
            examples.extend(_transcript(lines, first, block))
    return examples


def readme_examples() -> list[Example]:
    return parse(README.read_text(encoding="utf-8"))


# ---- comparing printed output with the README's ---------------------------------------------------
ELISION = re.compile(r"…|\.\.\.")


def line_regex(shown: str, volatile: Sequence[str] = ()) -> re.Pattern:
    """The README's line as a pattern: literal text, `…`/`...` as any text, and each span that a
    `volatile` expression matches replaced by that expression."""
    spans: list[tuple[int, int, str]] = [(m.start(), m.end(), ".*?") for m in ELISION.finditer(shown)]
    for v in volatile:
        spans += [(m.start(), m.end(), f"(?:{v})") for m in re.finditer(v, shown) if m.end() > m.start()]
    spans.sort(key=lambda s: (s[0], -s[1]))
    pattern, pos = "", 0
    for start, end, rx in spans:
        if start < pos:  # inside a span already replaced
            continue
        pattern += re.escape(shown[pos:start]) + rx
        pos = end
    return re.compile(pattern + re.escape(shown[pos:]))


def _match(actual: list[str], shown: list[re.Pattern | None]) -> bool:
    if not shown:
        return not actual
    if shown[0] is None:  # a `...` line: any number of lines
        return any(_match(actual[k:], shown[1:]) for k in range(len(actual) + 1))
    return bool(actual) and shown[0].fullmatch(actual[0]) is not None and _match(actual[1:], shown[1:])


def check_output(actual: str, shown: Sequence[str], volatile: Sequence[str] = (), ignore: Sequence[str] = (),
                 what: str = "") -> None:
    """Assert that `actual` (what the command printed) is what the README shows. Lines matching an
    `ignore` expression are dropped from `actual` first (a notice the README shows elsewhere)."""
    lines = [ln.rstrip() for ln in actual.replace("\r\n", "\n").split("\n")]
    lines = [ln for ln in lines if not any(re.fullmatch(rx, ln) for rx in ignore)]
    while lines and not lines[-1]:
        lines.pop()
    patterns = [None if s.strip() == "..." else line_regex(s.rstrip(), volatile) for s in shown]
    if not _match(lines, patterns):
        raise AssertionError(f"{what}: the output differs from the README's\n--- README shows:\n" + "\n".join(shown)
                             + "\n--- the program printed:\n" + "\n".join(lines))
