"""A command on a pseudo-terminal, for the README examples that show what a terminal shows
(progress bars, the chat REPL), and the screen it leaves: enough of a terminal (carriage return,
newline, erase line, cursor up) to render rich's progress display and a dumb-terminal prompt."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time

CSI = re.compile(rb"\x1b\[([0-9;?]*)([A-Za-z])|\x1b[()][A-Za-z0-9]|\x1b[=>]")


def render(raw: bytes) -> str:
    """The screen's lines after `raw` was written to a terminal (colours and cursor-visibility
    codes dropped)."""
    screen: list[list[str]] = [[]]
    row = col = 0
    pos = 0
    text = raw
    while pos < len(text):
        m = CSI.match(text, pos)
        if m:
            args, cmd = m.group(1) or b"", m.group(2) if m.lastindex and m.lastindex >= 2 else b""
            if cmd == b"K":
                screen[row] = [] if args in (b"2",) else screen[row][:col]
            elif cmd == b"A":
                row = max(0, row - int(args or b"1"))
            elif cmd == b"G":
                col = int(args or b"1") - 1
            pos = m.end()
            continue
        # one UTF-8 character
        n = 1
        b0 = text[pos]
        if b0 >= 0xF0:
            n = 4
        elif b0 >= 0xE0:
            n = 3
        elif b0 >= 0xC0:
            n = 2
        ch = text[pos:pos + n].decode("utf-8", "replace")
        pos += n
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            while len(screen) <= row:
                screen.append([])
        elif ch == "\x08":
            col = max(0, col - 1)
        elif ch >= " " or ch == "\t":
            line = screen[row]
            while len(line) < col:
                line.append(" ")
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return "\n".join("".join(line).rstrip() for line in screen)


class PtyProcess:
    """`bash -c CMD` with stdin, stdout and stderr on a new pseudo-terminal (120x40), in its own
    session (Ctrl-C written to it reaches the command as on a real terminal)."""

    def __init__(self, cmd: str, env: dict[str, str], cwd: str, cols: int = 120, rows: int = 40):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.fd = master
        self.raw = b""
        self.proc = subprocess.Popen(["bash", "-c", cmd], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                     start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)

    def _pump(self, timeout: float) -> None:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if r:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the command exited and the terminal closed
                data = b""
            if data:
                self.raw += data
            else:
                time.sleep(timeout)

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {what} after {timeout} s; the terminal shows:\n{render(self.raw)}")
            self._pump(0.1)

    def echo_off(self) -> bool:
        """The program reads keys itself (raw mode): what is typed now is not echoed twice."""
        return not termios.tcgetattr(self.fd)[3] & termios.ECHO

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the command to exit; (exit status, screen)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._pump(0.1)
        if self.proc.poll() is None:
            self.kill()
            raise AssertionError(f"still running after {timeout} s; the terminal shows:\n{render(self.raw)}")
        for _ in range(20):  # what it wrote just before exiting
            before = len(self.raw)
            self._pump(0.05)
            if len(self.raw) == before:
                break
        os.close(self.fd)
        return self.proc.returncode, render(self.raw)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
