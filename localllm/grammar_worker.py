"""Grammar compilation where a crash or a runaway compile costs one request, not the server.

llguidance compiles in native code: a grammar that recurses too deep overflows the stack
(SIGSEGV, seen at ~700 `$ref` links on an 8 MiB stack), and some compile for seconds. So a
grammar is first compiled, and its first token mask computed, by a worker process (`python -m
localllm.grammar_worker`, one per tokenizer, started at the first constrained request and kept)
under a time limit and a memory limit; only a grammar the worker compiled is compiled again in
the server, the same way (same library, tokenizer, limits and stack size), in a thread of its
own. A worker that crashes or overruns is killed and the request refused; the next one starts
a fresh worker.

The protocol on the worker's stdin/stdout: frames of an 8-byte big-endian length and UTF-8 text.
First a JSON header {vocab_size, eos_ids, memory_bytes, timeout_s}, then the tokenizer JSON,
answered with {} once the worker is ready; then, per check, a grammar, answered with a JSON
{"error": message or ""}.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable

STACK_BYTES = 64 << 20  # the compile thread's stack, in the worker and in the server alike
TIMEOUT_S = 5.0  # one compile and first mask in the worker
START_TIMEOUT_S = 60.0  # the worker's start (Python, llguidance, its tokenizer: ~1 s)
MEMORY_BYTES = 4 << 30  # the worker's address space (RLIMIT_AS)
_stack_lock = threading.Lock()


def parser_limits():
    """llguidance's own limits, the same on both sides; errors without the grammar's dump (they go
    back to the client)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def compile_grammar(tokenizer, grammar: str):
    """A matcher for `grammar` with its first mask computed (what may fail or take long happens
    here), built in a thread with a STACK_BYTES stack. Its error state says whether it compiled."""
    from llguidance import LLMatcher

    result: list = []

    def build():
        try:
            m = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
            if not m.is_error():
                m.compute_bitmask()
            result.append(m)
        except Exception as e:  # noqa: BLE001 - handed to the caller's thread
            result.append(e)

    with _stack_lock:  # threading.stack_size is process-wide: set it only for this thread's start
        old = threading.stack_size(STACK_BYTES)
        try:
            t = threading.Thread(target=build, name="grammar-compile", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


class WorkerError(Exception):
    """The worker crashed, overran its time, or could not be started; the message says which."""


class GrammarChecker:
    """The parent side: one worker process, used by one check at a time."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: list[int],
                 timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES):
        self._tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, eos_ids
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.starts = 0  # workers started (a crash or an overrun costs one)

    def check(self, grammar: str) -> str:
        """'' when the worker compiled `grammar` (and computed its first mask) cleanly, else
        llguidance's message. WorkerError when it crashed or overran (it is killed)."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            try:
                _send(proc.stdin, grammar.encode("utf-8"))
                answer = _receive(proc.stdout, time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._kill()
                raise WorkerError(f"it takes more than {self.timeout_s:g} s to compile") from None
            except (OSError, EOFError):
                code = self._kill()
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise WorkerError(f"it crashed the grammar compiler ({how})") from None
            return json.loads(answer)["error"]

    def _start(self) -> subprocess.Popen:
        self._kill()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "localllm.grammar_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._proc = proc
        self.starts += 1
        header = {"vocab_size": self.vocab_size, "eos_ids": self.eos_ids, "memory_bytes": self.memory_bytes,
                  "timeout_s": self.timeout_s}
        try:
            _send(proc.stdin, json.dumps(header).encode())
            _send(proc.stdin, self._tokenizer_json().encode("utf-8"))
            _receive(proc.stdout, time.monotonic() + START_TIMEOUT_S)  # its tokenizer is built: ready
        except (OSError, EOFError, TimeoutError) as e:
            self._kill()
            raise WorkerError(f"the grammar worker could not be started ({type(e).__name__})") from None
        return proc

    def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return code

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self):
        self._kill()


def _send(f, data: bytes) -> None:
    f.write(len(data).to_bytes(8, "big") + data)
    f.flush()


def _receive(f, deadline: float | None = None) -> bytes:
    """One frame from `f`; EOFError when it closes first. With a `deadline` (the server's side: `f`
    is a pipe read only here, unbuffered) TimeoutError when it has not come by then."""
    if deadline is None:
        head = f.read(8)
        data = f.read(int.from_bytes(head, "big")) if len(head) == 8 else b""
        if len(head) < 8 or len(data) < int.from_bytes(head, "big"):
            raise EOFError
        return data
    fd, buf, size = f.fileno(), b"", 8
    while len(buf) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, size - len(buf))  # never past this frame
        if not chunk:
            raise EOFError
        buf += chunk
        if size == 8 and len(buf) == 8:
            size += int.from_bytes(buf, "big")
    return buf[8:]


def main() -> None:
    import resource
    import signal

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    header = json.loads(_receive(stdin))
    limit = header["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from llguidance import LLTokenizer

    tokenizer = LLTokenizer(_receive(stdin).decode("utf-8"), n_vocab=header["vocab_size"],
                            eos_token=header["eos_ids"])
    _send(stdout, b"{}")  # ready: the time limit counts compiles only
    while True:
        try:
            grammar = _receive(stdin).decode("utf-8")
        except EOFError:  # the server closed the pipe: nothing more to do
            return
        # the server stops waiting after timeout_s and kills this process; should it be gone
        # itself, SIGALRM ends the compile (the pipe's end ends an idle worker)
        signal.alarm(int(2 * header["timeout_s"]) + 1)
        try:
            error = compile_grammar(tokenizer, grammar).get_error()
        except Exception as e:  # noqa: BLE001 - a message for the request, not a dead worker
            error = f"{type(e).__name__}: {e}"
        signal.alarm(0)
        _send(stdout, json.dumps({"error": error}).encode())


if __name__ == "__main__":
    main()
