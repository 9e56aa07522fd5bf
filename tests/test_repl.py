"""`localllm chat`: the ChatSession logic with the real default model, the prompt-toolkit loop
through a pipe input, and the pipe (non-TTY) mode of the real CLI."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from conftest import make_engine

from localllm.repl import ChatSession, FrameWriter, run_pipe, run_repl


@pytest.fixture(scope="module")
def engine(int4_model):
    return make_engine(int4_model)


@pytest.fixture
def session(engine):
    out, notes = [], []
    s = ChatSession(engine, "smollm2-135m", out=out.append, note=notes.append, temperature=0.0, max_tokens=6)
    s.outputs, s.notes = out, notes
    return s


def text(chunks: list[str]) -> str:
    return "".join(chunks)


def test_multiline_input(session):
    assert session.feed('"""') is None and session.in_block
    assert session.feed("first line") is None
    assert session.feed("second line") is None
    assert session.feed('"""') == "first line\nsecond line" and not session.in_block
    assert session.feed('"""one-liner"""') == "one-liner"
    assert session.feed('"""start') is None and session.feed('end"""') == "start\nend"
    assert session.feed("plain") == "plain"


def test_slash_commands(session, engine):
    requests = engine.cache_stats()["requests"]
    assert session.handle("/foo bar") is True
    assert "Unknown command '/foo'" in text(session.notes)
    assert engine.cache_stats()["requests"] == requests and session.messages == []  # never sent to the model
    session.handle("/?")
    assert "/set NAME VALUE" in text(session.outputs) and '"""' in text(session.outputs)
    session.handle("/set temperature 0.3")
    session.handle("/set top-k 5")
    session.handle("/set max_tokens none")
    assert (session.settings["temperature"], session.settings["top_k"], session.settings["max_tokens"]) == (0.3, 5, None)
    session.notes.clear()
    session.handle("/set temperature -1")
    session.handle("/set top_p 2")
    session.handle("/set top_k lots")
    session.handle("/set colour blue")
    n = text(session.notes)
    assert "invalid value for temperature" in n and "invalid value for top_p" in n and "not an integer" in n
    assert "usage: /set" in n
    assert (session.settings["temperature"], session.settings["top_p"]) == (0.3, 0.95)  # bad values not kept
    session.handle("/system You are terse.")
    assert session.conversation() == [{"role": "system", "content": "You are terse."}]
    session.outputs.clear()
    session.handle("/show")
    shown = text(session.outputs)
    assert "model: smollm2-135m" in shown and "temperature: 0.3" in shown and "You are terse." in shown
    assert session.handle("/stats") and "no reply yet" in text(session.outputs)
    assert session.handle("/bye") is False and session.handle("/exit") is False


def test_second_turn_is_served_from_prefix_cache(session):
    session.handle("Name one colour.")
    first = session.last
    assert first.completion_tokens > 0 and session.messages[-1]["role"] == "assistant"
    session.handle("And another one?")
    second = session.last
    assert second.prompt_tokens > first.prompt_tokens
    assert second.cached_tokens >= 16 * (first.prompt_tokens // 16) > 0  # every full block of turn 1's prompt
    session.outputs.clear()
    session.handle("/stats")
    assert f"prompt tokens: {second.prompt_tokens} ({second.cached_tokens} from prefix cache)" in text(session.outputs)
    assert "tok/s" in text(session.outputs) and "TTFT" in text(session.outputs)


@pytest.mark.parametrize("how", ["flag", "keyboard-interrupt"])
def test_ctrl_c_during_a_reply_keeps_the_session(session, engine, how):
    session.settings["max_tokens"] = 60
    seen = []

    def out(s):
        seen.append(s)
        if len(seen) == 3:  # Ctrl-C arrives while the reply streams
            if how == "flag":
                session.interrupt.set()  # what the REPL's SIGINT handler does
            else:
                raise KeyboardInterrupt

    session.out = out
    session.handle("Write a long story about a dragon.")
    assert session.last.interrupted and session.last.finish_reason == "interrupted"
    assert session.last.completion_tokens < 60
    assert session.messages[-1]["role"] == "assistant" and session.messages[-1]["content"]  # partial reply kept
    assert "reply stopped" in text(session.notes)
    assert not engine.has_unfinished() and engine.num_running == 0  # the request was aborted, blocks freed
    session.out = session.outputs.append
    session.settings["max_tokens"] = 4
    session.handle("Thanks.")  # the session goes on
    assert not session.last.interrupted and len(session.messages) == 4


def test_save_load_retry_undo(session, tmp_path):
    session.handle("/system Be brief.")
    session.handle("Say hi.")
    saved = [dict(m) for m in session.messages]
    f = tmp_path / "conv.json"
    session.handle(f"/save {f}")
    data = json.loads(f.read_text())
    assert data["messages"] == saved and data["system"] == "Be brief." and data["model"] == "smollm2-135m"
    session.handle("/clear")
    assert session.messages == [] and session.system == "Be brief."
    session.system = None
    session.handle(f"/load {f}")
    assert session.messages == saved and session.system == "Be brief."
    session.handle("/retry")
    assert len(session.messages) == 2 and session.messages[0] == saved[0] and session.last is not None
    session.handle("/undo")
    assert session.messages == []
    session.notes.clear()
    session.handle("/undo")
    session.handle("/retry")
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "wizard", "content": 1}]}')
    session.handle(f"/load {tmp_path / 'bad.json'}")
    session.handle(f"/load {tmp_path / 'missing.json'}")
    n = text(session.notes)
    assert "nothing to undo" in n and "nothing to retry" in n and "expected" in n and "cannot read" in n


def test_prompt_toolkit_loop_through_a_pipe(session, tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    hist = tmp_path / "history"
    with create_pipe_input() as inp:
        inp.send_text('"""\nline one\nline two\n"""\n')
        inp.send_text("\x03")  # Ctrl-C on an empty line: a hint, not an exit
        inp.send_text("/foo\n/stats\n")
        inp.send_text("\x04")  # Ctrl-D: leave
        code = run_repl(session, input=inp, output=DummyOutput(), history=hist)
    assert code == 0
    assert session.messages[0] == {"role": "user", "content": "line one\nline two"}
    n = text(session.notes)
    assert "Use Ctrl+D or /bye to exit." in n and "Unknown command '/foo'" in n
    assert "from prefix cache" in text(session.outputs)
    saved = hist.read_text()
    assert "/stats" in saved and "line one" in saved  # history persists across sessions


def test_frame_writer_keeps_order_and_coalesces():
    calls = []
    frames = FrameWriter(fps=1e-6)  # a frame lasts for ever: only the first chunk and flush() write
    out, note = frames.sink(lambda s: calls.append(("out", s))), frames.sink(lambda s: calls.append(("note", s)))
    for i in range(200):
        out(f"{i} ")
    note("[a note]\n")
    out("")  # nothing: no call
    out("tail\n")
    frames.flush()
    assert len(calls) <= 4 and frames.frames <= 2  # first chunk; then out, note, out in one frame
    assert "".join(s for who, s in calls if who == "out") == "".join(f"{i} " for i in range(200)) + "tail\n"
    assert [who for who, _ in calls][-3:] == ["out", "note", "out"] and calls[-2] == ("note", "[a note]\n")
    frames.close()
    assert not frames._thread.is_alive()

    def broken(s):
        raise OSError("terminal gone")

    frames = FrameWriter(fps=0)  # no frames: write as it comes
    frames.sink(broken)("x")
    with pytest.raises(OSError, match="terminal gone"):
        frames.flush()  # the writer's error reaches the REPL's thread
    frames.close()


class _Engine:
    """The shared engine, whose generate() presses Ctrl-C (SIGINT to this process, on this thread)
    after `after` outputs of the next request."""

    def __init__(self, engine, after: int):
        self._engine, self.after = engine, after
        self.threads = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args):
        self.threads.add(threading.current_thread())
        gen = self._engine.generate(*args)
        try:
            for i, o in enumerate(gen):
                if i == self.after:
                    self.after = -1
                    os.kill(os.getpid(), signal.SIGINT)
                yield o
        finally:
            gen.close()


def test_repl_streams_in_frames_and_ctrl_c_stops_a_reply(session, engine):
    """The terminal path: a reply reaches `out` intact and in order, in a bounded number of writes
    (not one per token), and Ctrl-C during it stops the reply, flushes its tail before the notice,
    and keeps the session (and this process's SIGINT handler)."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    log = []
    session.out = lambda s: log.append(("out", s))  # each call: one write + flush of the terminal
    session.note = lambda s: log.append(("note", s))
    handler = signal.getsignal(signal.SIGINT)
    with create_pipe_input() as inp:
        inp.send_text("Write a long story about a dragon.\nTell me about the sea.\nThanks!\n\x04")
        session.engine = _Engine(engine, after=-1)
        replies = []

        def reply(orig=session.reply):
            log.append(("reply", None))
            session.settings["max_tokens"] = [40, 200, 4][len(replies)]
            if len(replies) == 1:
                session.engine.after = 5  # Ctrl-C after 5 tokens of the second reply
            replies.append(orig())
            return replies[-1]

        session.reply = reply
        code = run_repl(session, input=inp, output=DummyOutput(), fps=1e-6)  # one frame lasts for ever
    assert code == 0 and signal.getsignal(signal.SIGINT) is handler
    # decoded where torch's OpenMP team lives: a worker thread gets a team of its own (see _reply_catching_sigint)
    assert session.engine.threads == {threading.main_thread()}
    assert not any(t.name == "localllm-frames" for t in threading.enumerate())
    assert replies[0].completion_tokens >= 20 and not replies[0].interrupted and not replies[2].interrupted
    assert replies[1].interrupted and 5 <= replies[1].completion_tokens < 200
    assert not engine.has_unfinished() and engine.num_running == 0
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3  # the stopped reply is kept
    starts = [i for i, (who, _) in enumerate(log) if who == "reply"] + [len(log)]
    for n, (a, b) in enumerate(zip(starts, starts[1:])):
        writes = [s for who, s in log[a + 1:b] if who == "out"]
        assert "".join(writes) == session.messages[2 * n + 1]["content"] + "\n"  # intact, in order
        assert len(writes) <= 2  # the first chunk at once, the rest when the reply ends
    after_stop = log[starts[1] + 1:starts[2]]
    assert after_stop[-1][0] == "note" and "reply stopped" in after_stop[-1][1]  # after the reply's tail


def test_pipe_mode_reads_lines(session):
    code = run_pipe(session, iter(['"""\n', "a\n", 'b"""\n', "/show\n", "/bye\n", "never sent\n"]))
    assert code == 0 and session.messages[0]["content"] == "a\nb" and len(session.messages) == 2
    assert run_pipe(session, iter(['"""\n', "unterminated\n"])) == 1


def test_chat_cli_from_a_pipe(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCALLLM_HOME": str(tmp_path)}
    env.pop("LOCALLLM_MODELS", None)
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "chat", "-n", "4", "--temperature", "0"],
                       input="Hello!\nWhat did I just say?\n/stats\n/foo\n", capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stdout.splitlines() if line.startswith("prompt tokens:")]
    assert len(stats) == 1 and "(0 from prefix cache)" not in stats[0]  # turn 2 hit the cache
    assert "Unknown command '/foo'" in r.stderr and "\x1b" not in r.stdout


def test_set_refuses_what_the_next_message_would_fail_on(session):
    """`/set seed 10**30` was echoed, then the next message killed the REPL (issue #19)."""
    session.handle(f"/set seed {10 ** 30}")
    session.handle("/set temperature inf")
    notes = text(session.notes)
    assert "invalid value for seed: seed: must be in -2^63..2^64-1" in notes and "invalid value for temperature" in notes
    assert session.settings["seed"] is None and session.settings["temperature"] == 0.0
    session.handle(f"/set seed {2 ** 63}")  # in range: kept, and the next message works
    assert session.settings["seed"] == 2 ** 63
    session.handle("Hi")
    assert session.last.completion_tokens > 0 and [m["role"] for m in session.messages] == ["user", "assistant"]


def test_a_failing_message_costs_that_message_only(session, monkeypatch):
    real = session.engine.generate

    def broken(*a, **k):
        raise RuntimeError("boom")
        yield
    monkeypatch.setattr(session.engine, "generate", broken)
    assert session.handle("first") is True
    assert "Error: RuntimeError: boom; the message was not kept" in text(session.notes) and session.messages == []
    monkeypatch.setattr(session.engine, "generate", real)
    session.handle("second")
    assert [m["content"] for m in session.messages][:1] == ["second"]


def test_pipe_mode_skips_a_line_that_is_not_utf8(session):
    code = run_pipe(session, iter([b"/set top_k 3\n", b"caf\xe9\n", b"/set top_k 4\r\n", b"/bye\n"]))
    assert code == 0
    assert "input line 2 is not UTF-8 text (byte 0xe9 at offset 3); skipped" in text(session.notes)
    assert session.settings["top_k"] == 4 and session.messages == []
