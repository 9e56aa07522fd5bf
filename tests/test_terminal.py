"""Model text never drives the terminal (issue #29): `localllm run` and `localllm chat`, the real
executables on a pseudo-terminal and through pipes, with a model whose every reply is a chosen
string full of escape sequences (tests/hub_mirror.py: tiny_checkpoint_that_says), one token each,
so that sequences are split across streamed deltas too."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_mirror import tiny_checkpoint_that_says

from localllm.terminal import escape_controls

# the reply, cut where one token ends: ESC ends each token, its "[0m" starts the next
TOKEN = "[0m \x1b]0;PWNED3\x07 \x1b[31mRED\x1b"
REPLY = TOKEN * 3  # -n 3
ATTACK = "\x1b[31mRED\x1b[0m \x1b]0;PWNED3\x07"  # what the reply was, found inside REPLY
SHOWN = "^[[31mRED^[[0m ^[]0;PWNED3^G"
assert ATTACK in REPLY and escape_controls(ATTACK) == SHOWN
FLAGS = ["-n", "3", "--temperature", "0", "--ctx", "256", "--threads", "1", "--enforce-eager"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_checkpoint_that_says(tmp_path_factory.mktemp("says") / "model", TOKEN)


@pytest.fixture
def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "LOCALLLM_HOME": os.environ["LOCALLLM_HOME"], "TERM": "xterm",
            "PROMPT_TOOLKIT_NO_CPR": "1", "HF_HUB_OFFLINE": "1"}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "localllm.cli", *args]


class Pty:
    """A process on a pseudo-terminal (stdin, stdout and stderr: what a user's shell gives it);
    everything it writes is collected, with the terminal's \\r\\n turned back into \\n."""

    def __init__(self, argv: list[str], env: dict, cwd: Path | None = None):
        master, slave = pty.openpty()
        self.master, self.data, self.mark = master, b"", 0
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                     start_new_session=True)
        os.close(slave)

    def read(self, timeout: float) -> bool:
        """Collect what arrives within `timeout`; False once the process closed the terminal."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 1 << 16)
        except OSError:  # EIO: every writer is gone
            return False
        self.data += chunk
        return bool(chunk)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace").replace("\r\n", "\n")

    def expect(self, needle: str, timeout: float = 120) -> None:
        """Wait until `needle` has been written since the last expect (a bound against a hang)."""
        deadline = time.monotonic() + timeout
        while needle not in self.text[self.mark:]:
            assert time.monotonic() < deadline, f"never saw {needle!r} in {self.text!r}"
            assert self.read(0.2) or needle in self.text[self.mark:], f"exited before {needle!r}: {self.text!r}"
        self.mark = self.text.index(needle, self.mark) + len(needle)

    def send(self, line: str) -> None:
        os.write(self.master, line.encode())

    def wait(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while self.read(0.2):
            assert time.monotonic() < deadline, f"still running: {self.text!r}"
        code = self.proc.wait(timeout)
        os.close(self.master)
        return code


def test_escape_controls_keeps_text_and_shows_controls():
    assert escape_controls("plain text, ünïcödé 🙂\n\tindented") == "plain text, ünïcödé 🙂\n\tindented"
    assert escape_controls(ATTACK) == SHOWN
    assert escape_controls("a\rb\x08c\x00d\x7fe\x9b31mf\x9d0;t\x9c") == "a^Mb^Hc^@d^?eM-^[31mfM-^]0;tM-^\\"
    # streamed: a sequence cut anywhere reads the same as whole
    assert all(escape_controls(ATTACK[:i]) + escape_controls(ATTACK[i:]) == SHOWN for i in range(len(ATTACK)))


def test_run_on_a_terminal_shows_escapes(model, env):
    p = Pty(cli("run", str(model), "hi", *FLAGS), env)
    assert p.wait() == 0, p.text
    assert escape_controls(REPLY) + "\n" in p.text and SHOWN in p.text
    assert "\x1b" not in p.text and "\x07" not in p.text, p.text  # nothing reached the terminal as a control


def test_run_piped_is_the_answer_byte_for_byte(model, env):
    r = subprocess.run(cli("run", str(model), "hi", *FLAGS), env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPLY + "\n").encode()  # data: exactly what the model wrote
    assert b"\x1b" not in r.stderr


def test_run_raw_output_opts_out_on_a_terminal(model, env):
    p = Pty(cli("run", str(model), "hi", *FLAGS, "--raw-output"), env)
    assert p.wait() == 0, p.text
    assert REPLY + "\n" in p.text and SHOWN not in p.text


def conversation(tmp_path: Path) -> Path:
    f = tmp_path / "crafted.json"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Say \x1b[31mRED\x07"},
                                          {"role": "assistant", "content": "\x1b]0;PWNED1\x07"}]}))
    return f


def test_chat_repl_after_load_and_retry_shows_escapes(model, env, tmp_path):
    """The prompt-toolkit REPL on a terminal: /load a crafted conversation, /retry its reply. The
    reply is shown with visible escapes (prompt-toolkit's own sequences around it are its business),
    the conversation keeps what the model wrote (/save)."""
    saved = tmp_path / "saved.json"
    p = Pty(cli("chat", str(model), "--no-history", *FLAGS), env, cwd=tmp_path)
    try:
        p.expect(">>> ")
        p.send(f"/load {conversation(tmp_path)}\r")
        p.expect("loaded 2 messages")
        p.expect(">>> ")
        p.send("/retry\r")
        p.expect(escape_controls(REPLY) + "\n")
        p.expect(">>> ")
        p.send(f"/save {saved}\r")
        p.expect("saved 2 messages")
        p.expect(">>> ")
        p.send("/bye\r")
        assert p.wait() == 0, p.text
    finally:
        p.proc.kill()
        p.proc.wait()
    assert SHOWN in p.text
    for raw in ("RED\x1b", "\x1b[31mRED", "\x1b]", "\x07"):  # no colour, no title, no bell
        assert raw not in p.text, (raw, p.text)
    assert json.loads(saved.read_text())["messages"][-1] == {"role": "assistant", "content": REPLY}


@pytest.mark.parametrize("raw", [False, True], ids=["default", "raw-output"])
def test_chat_piped_shows_escapes_unless_raw_output(model, env, tmp_path, raw):
    """Piped chat is a transcript: escaped like the REPL, with or without a terminal; --raw-output
    writes the reply as the model wrote it."""
    r = subprocess.run(cli("chat", str(model), *FLAGS, *(["--raw-output"] if raw else [])), env=env,
                       capture_output=True, timeout=120, input=f"/load {conversation(tmp_path)}\n/retry\n".encode())
    assert r.returncode == 0, r.stderr
    reply = REPLY if raw else escape_controls(REPLY)
    assert r.stdout.decode().split("\n") == [f"loaded 2 messages from {conversation(tmp_path)}", reply, ""]
    assert b"\x1b" not in r.stderr
    if not raw:
        assert b"\x1b" not in r.stdout and b"\x07" not in r.stdout
