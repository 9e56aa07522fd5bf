"""`localllm chat`: a ChatSession (conversation, settings, slash commands, one streamed reply at a
time) and two thin I/O loops around it: prompt-toolkit on a terminal, plain lines from a pipe.

One engine lives for the whole session, so each turn re-sends the conversation and the prefix cache
serves the earlier turns' KV: `/stats` shows how many prompt tokens came from the cache.

On a terminal a reply is decoded on the main thread (Ctrl-C only sets a flag there) and drawn in
frames, at most 30 writes a second whatever the token rate (FrameWriter), so it streams as fast as
`localllm run` or a piped chat; piped output is written token by token, as it always was.

A reply stopped with Ctrl-C is KEPT in the conversation as far as it got (what you saw is what the
model remembers); `/retry` regenerates it, `/undo` drops the exchange.

Model text is shown, never obeyed: its control characters (escape sequences) reach the terminal as
^[ and the like (terminal.py), piped or not: chat's output is a transcript to read. The
conversation keeps the text as the model wrote it. `escape=False` (chat --raw-output) opts out.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .paths import data_home
from .terminal import escape_controls

HELP = """\
Commands:
  /help, /?                 this help
  /system [TEXT]            show or set the system prompt
  /set NAME VALUE           temperature, top_p, top_k, max_tokens, seed (VALUE 'none' unsets max_tokens/seed)
  /set think on|hide|off    reasoning models: show the reasoning dimmed, hide it, or ask for none
  /show                     model and settings
  /stats                    last reply: tokens, TTFT, tokens/s, prompt tokens served from the prefix cache
  /clear                    forget the conversation (keeps the system prompt)
  /image FILE               attach an image to the next message (vision models; a path in a message works too)
  /save FILE, /load FILE    the conversation as JSON
  /retry                    regenerate the last reply
  /undo                     drop the last exchange
  /exit, /bye               leave (or Ctrl+D)
Input: \"\"\" starts and ends a multi-line message. Ctrl+C stops a reply (the partial reply is kept)."""

SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int,
            "min_p": float, "repeat_penalty": float}
THINK_MODES = ("on", "hide", "off")
DIM, UNDIM = "\x1b[2m", "\x1b[22m"


def history_path() -> Path:
    return data_home() / "history"


@dataclass
class ReplyStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    finish_reason: str | None = None
    interrupted: bool = False


class InterruptFlag:
    """threading.Event's set/clear/is_set without its lock, so that the REPL's SIGINT handler can set
    it: Event.set in a handler that interrupted Event.clear (or a first Ctrl-C's set) never returns."""

    __slots__ = ("_on",)

    def __init__(self):
        self._on = False

    def set(self) -> None:
        self._on = True

    def clear(self) -> None:
        self._on = False

    def is_set(self) -> bool:
        return self._on


class ChatSession:
    """Everything of `chat` except the terminal. `out` gets replies and command output, `note`
    gets hints and errors (the same terminal in the REPL; stderr when reading a pipe)."""

    def __init__(self, engine, model_name: str = "", system: str | None = None,
                 out: Callable[[str], None] | None = None, note: Callable[[str], None] | None = None,
                 think: str = "on", escape: bool = True, **settings):
        if think not in THINK_MODES:
            raise ValueError(f"think must be one of {', '.join(THINK_MODES)}, got {think!r}")
        self.think = think
        self.escape = escape  # model text (and names and errors that may carry it) with controls made visible
        self.dim = False  # a terminal: reasoning is written dimmed into the reply; else to `note`
        self.engine = engine
        self.model_name = model_name
        self.system = system
        self.messages: list[dict] = []
        self.settings = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "max_tokens": None, "seed": None,
                         "min_p": 0.0, "repeat_penalty": 1.0}
        self.settings.update({k: v for k, v in settings.items() if k in SETTABLE})
        self.params()  # fail early on bad settings
        self.out = out or _stdout
        self.note = note or _stdout
        self.interrupt = InterruptFlag()
        self.last: ReplyStats | None = None
        self._block: list[str] | None = None  # lines of an open \"\"\" block
        self.images: list[bytes] = []  # attached by /image to the next message

    def shown(self, text: str) -> str:
        """Text that is not ours (the model's, a file's, an error's) as it may reach the terminal."""
        return escape_controls(text) if self.escape else text

    # ---- input ----------------------------------------------------------------------------
    @property
    def in_block(self) -> bool:
        return self._block is not None

    def cancel_block(self) -> None:
        self._block = None

    def feed(self, line: str) -> str | None:
        """One input line -> a complete message/command, or None while a \"\"\" block is open."""
        if self._block is None:
            if not line.lstrip().startswith('"""'):
                return line
            rest = line.lstrip()[3:]
            if rest.endswith('"""'):  # \"\"\"one line\"\"\"
                return rest[:-3]
            self._block = [rest] if rest else []
            return None
        if line.rstrip().endswith('"""'):
            self._block.append(line.rstrip()[:-3])
            text, self._block = "\n".join(self._block).strip("\n"), None
            return text
        self._block.append(line)
        return None

    def handle(self, text: str) -> bool:
        """Act on one complete input. False: the user asked to leave."""
        if text.startswith("/"):
            return self.command(text)
        if not text.strip():
            return True
        self.messages.append({"role": "user", "content": self._content(text)})
        self.reply()
        return True

    def _content(self, text: str) -> str | list[dict]:
        """A message's content: the text, with the /image attachments and (a vision model) the
        image files named in it as image parts."""
        from .model.vision.images import ImageInputError, images_in_prompt, read_image_file

        images, self.images = self.images, []
        if getattr(self.engine, "vision", None) is not None:
            text, paths = images_in_prompt(text)
            try:
                images += [read_image_file(p) for p in paths]
            except ImageInputError as e:
                self.note(self.shown(f"Error: {e}; the image was left out") + "\n")
        if not images:
            return text
        return [*({"type": "image", "image": b} for b in images), {"type": "text", "text": text}]

    # ---- generation -----------------------------------------------------------------------
    def params(self):
        """The settings as SamplingParams; SamplingError when one is out of range (checked like the
        CLI flags, so that /set refuses what would fail at the next message)."""
        from .sampling import SamplingParams

        s = self.settings
        return SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                              top_k=s["top_k"], min_p=s["min_p"], repetition_penalty=s["repeat_penalty"],
                              seed=s["seed"])

    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def reply(self) -> ReplyStats | None:
        """Stream the assistant's answer to the conversation; stops early when `interrupt` is set
        (or on KeyboardInterrupt). The partial answer is kept."""
        from .chat import ChatTemplateError
        from .engine.engine import ContextLengthError
        from .reasoning import chat_prompt, reasons
        from .reply_stream import ReplyDelta, ReplyStream

        self.interrupt.clear()
        stats, text, last = ReplyStats(), "", None
        t0 = time.perf_counter()
        first = None
        prompt, reply = self.conversation(), ReplyStream()  # a plain model: the text is the answer
        thought = False  # reasoning has been shown (dimmed: the terminal is still dim)

        def show(part: ReplyDelta) -> None:
            nonlocal text, thought
            reasoning, answer = part.reasoning, part.content
            if reasoning and self.think == "on":
                reasoning = self.shown(reasoning)
                if not thought:
                    reasoning = (DIM if self.dim else "") + reasoning.lstrip("\n")
                (self.out if self.dim else self.note)(reasoning)
                thought = True
            if answer:
                if thought:  # a blank line between the reasoning and the answer
                    (self.out if self.dim else self.note)((UNDIM if self.dim else "") + "\n")
                    thought = False
                text += answer  # the conversation keeps the answer, as the templates expect
                self.out(self.shown(answer))

        gen = None
        try:
            kind = reasons(getattr(self.engine.tokenizer, "chat_template", None))
            if kind:
                prompt, inside = chat_prompt(self.engine, prompt, False if self.think == "off" else None)
                reply = ReplyStream(reasoning=kind, inside=inside)
            gen = self.engine.generate(prompt, self.params())
            for o in gen:
                if first is None:
                    first = time.perf_counter()
                last = o
                if o.delta:
                    show(reply.feed(o.delta))
                if self.interrupt.is_set() and not o.finished:
                    stats.interrupted = True
                    break
            show(reply.finish())
        except KeyboardInterrupt:
            stats.interrupted = True
        except (ContextLengthError, ChatTemplateError) as e:
            self.messages.pop()
            self.note(self.shown(f"Error: {e}. Use /undo or /clear to make room.") + "\n")
            return None
        except Exception as e:  # noqa: BLE001 - a bad message costs that message, never the session
            self.messages.pop()
            self.note(self.shown(f"Error: {type(e).__name__}: {e}; the message was not kept") + "\n")
            return None
        finally:
            if gen is not None:
                gen.close()  # aborts the request (frees its KV blocks) if it did not finish
            if thought and self.dim:  # stopped while reasoning: the terminal leaves dim text
                self.out(UNDIM)
        end = time.perf_counter()
        if last is not None:
            n = len(last.token_ids)
            stats.prompt_tokens, stats.cached_tokens, stats.completion_tokens = (
                last.num_prompt_tokens, last.num_cached_tokens, n)
            stats.finish_reason = "interrupted" if stats.interrupted else last.finish_reason
            stats.ttft_ms = (first - t0) * 1000
            stats.tokens_per_s = (n - 1) / (end - first) if n > 1 and end > first else 0.0
            stats.seconds = end - t0
        self.out("\n")
        if stats.interrupted:
            self.note("[reply stopped; the partial reply is kept: /retry to regenerate, /undo to drop it]\n")
        if text or not stats.interrupted:
            self.messages.append({"role": "assistant", "content": text})
        else:  # stopped before any text: as if the message was never sent
            self.messages.pop()
        self.last = stats
        return stats

    # ---- slash commands -------------------------------------------------------------------
    def command(self, line: str) -> bool:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        name = name.lower()
        if name in ("/exit", "/bye", "/quit"):
            return False
        handler = {
            "/help": self._help, "/?": self._help, "/system": self._system, "/set": self._set,
            "/show": self._show, "/stats": self._stats, "/clear": self._clear, "/save": self._save,
            "/load": self._load, "/retry": self._retry, "/undo": self._undo, "/image": self._image,
        }.get(name)
        if handler is None:
            self.note(f"Unknown command '{name}'. Type /? for help\n")
            return True
        handler(arg)
        return True

    def _help(self, arg: str) -> None:
        self.out(HELP + "\n")

    def _system(self, arg: str) -> None:
        if not arg:
            self.out(f"system prompt: {self.system!r}\n" if self.system else "no system prompt set\n")
            return
        self.system = arg
        self.out("system prompt set\n")

    def _set(self, arg: str) -> None:
        from .sampling import SamplingError

        key, _, value = arg.partition(" ")
        key, value = key.replace("-", "_").lower(), value.strip()
        if key == "system":
            return self._system(value)
        if key == "think":
            if value.lower() not in THINK_MODES:
                self.note(f"usage: /set think {'|'.join(THINK_MODES)} (show the reasoning dimmed, hide it, or ask "
                          "the model not to reason)\n")
                return
            self.think = value.lower()
            self.out(f"think = {self.think}\n")
            return
        if key not in SETTABLE or not value:
            self.note(f"usage: /set {{{'|'.join(SETTABLE)}}} VALUE\n")
            return
        try:
            if value.lower() == "none" and key in ("max_tokens", "seed"):
                v = None
            else:
                v = SETTABLE[key](value)
        except ValueError:
            self.note(f"invalid value for {key}: {value!r} is not {'an integer' if SETTABLE[key] is int else 'a number'}\n")
            return
        old = self.settings[key]
        self.settings[key] = v
        try:
            self.params()
        except SamplingError as e:
            self.settings[key] = old
            self.note(f"invalid value for {key}: {e}\n")
            return
        self.out(f"{key} = {v}\n")

    def _show(self, arg: str) -> None:
        loaded = getattr(self.engine, "loaded", None)
        lines = [f"model: {self.model_name}"]
        if loaded is not None:
            lines += [f"path: {loaded.source}", f"precision: {loaded.precision}"]
        lines.append(f"context: {self.engine.max_model_len} tokens")
        lines += [f"{k}: {v}" for k, v in self.settings.items()]
        lines.append(f"think: {self.think}")
        lines.append(f"system: {self.system!r}" if self.system else "system: (none)")
        lines.append(f"messages: {len(self.messages)}")
        self.out(self.shown("\n".join(lines)) + "\n")

    def _stats(self, arg: str) -> None:
        s = self.last
        if s is None:
            self.out("no reply yet\n")
            return
        total = self.engine.cache_stats()
        self.out(f"prompt tokens: {s.prompt_tokens} ({s.cached_tokens} from prefix cache) | "
                 f"completion tokens: {s.completion_tokens} | TTFT: {s.ttft_ms:.0f} ms | "
                 f"{s.tokens_per_s:.1f} tok/s | finish: {s.finish_reason}\n"
                 f"session: {total['prompt_tokens']} prompt tokens, hit rate {total['hit_rate']:.0%}\n")

    def _image(self, arg: str) -> None:
        from .model.vision.images import ImageInputError, decode_image, read_image_file

        if not arg:
            self.note("usage: /image FILE\n")
            return
        if getattr(self.engine, "vision", None) is None:
            self.note(f"Error: {self.model_name or 'this model'} takes no images (a text-only model)\n")
            return
        try:
            data = read_image_file(arg)
            decode_image(data, arg)  # a bad file is refused now, not with the next message
        except ImageInputError as e:
            self.note(self.shown(f"Error: {e}") + "\n")
            return
        self.images.append(data)
        self.out(f"attached {arg} to the next message ({len(self.images)} image(s))\n")

    def _clear(self, arg: str) -> None:
        self.messages.clear()
        self.last = None
        self.out("cleared the conversation" + (" (system prompt kept)" if self.system else "") + "\n")

    def _save(self, arg: str) -> None:
        if not arg:
            self.note("usage: /save FILE\n")
            return
        data = {"model": self.model_name, "system": self.system, "settings": self.settings,
                "messages": self.messages}
        try:
            Path(arg).expanduser().write_text(json.dumps(data, indent=2, ensure_ascii=False, default=_base64) + "\n")
        except OSError as e:
            self.note(f"cannot save to {arg}: {e.strerror or e}\n")
            return
        self.out(f"saved {len(self.messages)} messages to {arg}\n")

    def _load(self, arg: str) -> None:
        if not arg:
            self.note("usage: /load FILE\n")
            return
        try:
            data = json.loads(Path(arg).expanduser().read_text())
        except OSError as e:
            self.note(f"cannot read {arg}: {e.strerror or e}\n")
            return
        except ValueError as e:
            self.note(f"{arg} is not JSON: {e}\n")
            return
        msgs = data.get("messages", data.get("conversation")) if isinstance(data, dict) else data
        system = data.get("system") if isinstance(data, dict) else None
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str) for m in msgs):
            self.note(f"{arg}: expected {{\"messages\": [{{\"role\": \"user\"|\"assistant\", \"content\": str}}]}}\n")
            return
        if msgs and msgs[0]["role"] == "system":
            system, msgs = msgs[0]["content"], msgs[1:]
        self.messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
        self.system = system
        self.last = None
        self.out(f"loaded {len(self.messages)} messages from {arg}\n")

    def _retry(self, arg: str) -> None:
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            self.note("nothing to retry\n")
            return
        self.reply()

    def _undo(self, arg: str) -> None:
        if not self.messages:
            self.note("nothing to undo\n")
            return
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.out("removed the last exchange\n")

    def stats_dict(self) -> dict | None:
        return asdict(self.last) if self.last else None


def _base64(obj) -> str:
    """An attached image's bytes in a saved conversation."""
    import base64

    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode()
    raise TypeError(f"{type(obj).__name__} is not JSON")


def _stdout(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


# ---- the two loops ----------------------------------------------------------------------------
def run_pipe(session: ChatSession, lines) -> int:
    """Non-interactive: one input line at a time (\"\"\" blocks work), replies on stdout. Lines may
    be bytes (stdin's buffer): one that is not UTF-8 is reported and skipped, the session goes on."""
    for number, raw in enumerate(lines, 1):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                session.note(f"Error: input line {number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                             f"{e.start}); skipped\n")
                continue
        text = session.feed(raw.rstrip("\r\n") if raw.endswith("\r\n") else raw.rstrip("\n"))
        if text is not None and not session.handle(text):
            return 0
    if session.in_block:
        session.note('Error: input ended inside a """ block\n')
        return 1
    return 0


class FrameWriter:
    """Streams text to a terminal in frames: `sink(write)` returns a callable that only queues its
    text; a writer thread hands the queue to the `write`s at most `fps` times a second (a first
    chunk at once, then whatever piled up during the frame), in order across all sinks, whatever
    the token rate. Terminal I/O (a write and flush per call of `_stdout`, and the terminal's
    redraw of it) thus costs a frame, not a token, and never blocks the decode loop.
    `flush()` returns once everything queued so far has been written (end of a reply, Ctrl-C,
    before the prompt comes back); `close()` flushes and stops the thread."""

    def __init__(self, fps: float = 30.0):
        self.interval = 1.0 / fps if fps > 0 else 0.0
        self.frames = 0  # batches written
        self._queue: list[tuple[Callable[[str], None], str]] = []
        self._cv = threading.Condition()
        self._urgent = 0  # flush() calls waiting: write now, not at the end of the frame
        self._busy = False  # the writer is writing a batch it took off the queue
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="localllm-frames", daemon=True)
        self._thread.start()

    def sink(self, write: Callable[[str], None]) -> Callable[[str], None]:
        def put(text: str) -> None:
            if not text:
                return
            with self._cv:
                if not self._queue:
                    self._cv.notify_all()  # the writer waits for a first chunk, not for each one
                self._queue.append((write, text))
        return put

    def flush(self) -> None:
        with self._cv:
            self._urgent += 1
            self._cv.notify_all()
            try:
                while (self._queue or self._busy) and self._thread.is_alive():
                    self._cv.wait()
            finally:
                self._urgent -= 1
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()

    def _run(self) -> None:
        last = float("-inf")
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                while not self._urgent and not self._closed:
                    left = last + self.interval - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch, self._queue = self._queue, []
                self._busy = True
            try:
                start = 0
                for i in range(1, len(batch) + 1):  # one call per run of the same sink
                    if i == len(batch) or batch[i][0] is not batch[start][0]:
                        batch[start][0]("".join(t for _, t in batch[start:i]))
                        start = i
            except BaseException as e:  # e.g. the terminal is gone: raised again by flush()
                with self._cv:
                    self._error = self._error or e
            finally:
                last = time.monotonic()
                with self._cv:
                    self.frames += 1
                    self._busy = False
                    self._cv.notify_all()


def _reply_catching_sigint(session: ChatSession, text: str, frames: FrameWriter | None = None) -> bool:
    """Handle one input on THIS thread with Ctrl-C (SIGINT) only setting the interrupt flag: the
    engine is never stopped half-way through a step, the reply's tail is flushed, the session goes on.

    Not a worker thread: torch's OpenMP (libgomp) gives every thread that runs a parallel region a
    team of its own, and once it manages more threads than there are CPUs (the main thread's team
    from loading + the worker's) it barely spins at its barriers, sleeping on a futex instead:
    ~400 context switches per token in the worker, its decode 13-27% slower than a piped chat here
    (bench/repl_tty.py; half the speed in tmux on an idle 2-core machine)."""
    if threading.current_thread() is not threading.main_thread():
        alive = session.handle(text)  # signal handlers can only be set from the main thread
        if frames is not None:
            frames.flush()
        return alive

    def on_sigint(signum, frame):
        session.interrupt.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        alive = session.handle(text)
        if frames is not None:
            frames.flush()  # the tail of the reply (and its notes) before the prompt comes back
        return alive
    finally:
        signal.signal(signal.SIGINT, previous)


def run_repl(session: ChatSession, input=None, output=None, history: Path | None = None,
             banner: str | None = None, catch_sigint: bool = True, fps: float = 30.0) -> int:
    """The prompt-toolkit loop. `input`/`output` let tests drive it with a pipe input. While it
    runs, the session's `out` and `note` go through a FrameWriter (at most `fps` writes a second)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    hist = InMemoryHistory()
    if history is not None:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            hist = FileHistory(str(history))
        except OSError:
            session.note(f"(cannot write history to {history}; history is not saved)\n")
    kb = KeyBindings()

    @kb.add("c-c")
    def _(event):  # Ctrl-C: clear a typed line; on an empty line, say how to leave
        buf = event.current_buffer
        if buf.text:
            buf.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt)

    prompt = PromptSession(history=hist, key_bindings=kb, input=input, output=output)
    if banner:
        session.note(session.shown(banner) + "\n")
    frames = FrameWriter(fps)
    out, note = session.out, session.note
    session.out, session.note = frames.sink(out), frames.sink(note)
    session.dim = True  # a terminal: reasoning is shown dimmed in the reply
    try:
        while True:
            frames.flush()  # nothing of ours may reach the terminal while prompt-toolkit draws
            try:
                line = prompt.prompt("... " if session.in_block else ">>> ",
                                     placeholder=None if session.in_block else "Send a message (/? for help)")
            except KeyboardInterrupt:
                if session.in_block:
                    session.cancel_block()
                else:
                    session.note("Use Ctrl+D or /bye to exit.\n")
                continue
            except EOFError:
                return 0
            text = session.feed(line)
            if text is None:
                continue
            if catch_sigint:
                alive = _reply_catching_sigint(session, text, frames)
            else:
                alive = session.handle(text)
            if not alive:
                return 0
    finally:
        session.out, session.note = out, note
        frames.close()
