"""Decode speed of `localllm chat` on a terminal vs through a pipe (no tmux needed).

    python bench/repl_tty.py                      # embedded model, 3 runs each, 256 tokens per reply
    python bench/repl_tty.py --runs 5 -n 512 --threads 2 --model smollm2-135m
    python bench/repl_tty.py --code /tmp/old-checkout --code .   # two versions of the code, interleaved
    python bench/repl_tty.py --nice -20 --wait-idle 60           # on a machine shared with others' jobs

tty:   `localllm chat` under a pseudo-terminal (os.openpty, 80x24, CPR queries answered like a
       terminal would): waits for the prompt, types the message, reads the screen until the next
       prompt, then types /stats and reads the reply's decode tok/s from it.
piped: `printf 'MESSAGE\\n/stats\\n' | localllm chat`, tok/s from the same /stats line.

Each run starts a fresh process (so model load is not in the figure: /stats times only the reply);
run it once first where the compiled CPU step of the model is not built yet (the first chat builds
it in the background and answers eagerly meanwhile).
Prints the median tok/s of each mode, and for tty the number of write() calls that reached the
terminal during the reply (`chunks`: reads of the terminal's master side that returned data, a
lower bound of the chat's writes). Runs of the modes (and of the --code checkouts) alternate.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import select
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import termios
import time

STATS = re.compile(r"completion tokens: (\d+) \| TTFT: (\d+) ms \| ([\d.]+) tok/s")
PROMPT = b">>> "
ACCEPTED = b"\x1b[?2004l"  # bracketed paste off: prompt-toolkit has accepted the line and left the screen
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


def cli(args) -> list[str]:
    if args.cmd:
        cmd = shlex.split(args.cmd)
    else:
        exe = shutil.which("localllm", path=os.path.dirname(sys.executable)) or shutil.which("localllm")
        cmd = [exe] if exe else [sys.executable, "-m", "localllm.cli"]
    cmd += ["chat"] + ([args.model] if args.model else []) + ["--no-history", "-n", str(args.n), "--temperature", "0"]
    cmd += shlex.split(args.chat_args)
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


NICE: int | None = None  # --nice


def _renice() -> None:
    """In the child: --nice for its scheduling autogroup (the whole session; with autogroups a
    plain nice only ranks a session's own processes), else for itself."""
    if NICE is None:
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(NICE))
    except OSError:
        os.nice(NICE)


def _controlling_tty() -> None:
    """In the child, a session leader by now: its terminal becomes the controlling one, so that
    Ctrl-C (\\x03) typed into it is SIGINT, as in a real terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    _renice()


class Pty:
    """A child on a pseudo-terminal; `read_until` collects its output and answers CPR queries."""

    def __init__(self, cmd: list[str], env: dict):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True, preexec_fn=_controlling_tty)
        os.close(slave)
        self.buf = b""
        self.reads = 0  # read() calls that returned data: a lower bound of the child's write() calls

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def read_until(self, pattern: bytes, start: int, timeout: float) -> int:
        """Read until `pattern` shows up after offset `start` -> its offset."""
        deadline = time.monotonic() + timeout
        while (i := self.buf.find(pattern, start)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                tail = ANSI.sub(b"", self.buf[-2000:]).decode(errors="replace")
                raise RuntimeError(f"no {pattern!r} within {timeout:.0f} s; screen tail:\n{tail}")
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                if data:
                    self.reads += 1
                    self.buf += data
                    for _ in range(data.count(b"\x1b[6n")):  # cursor position request
                        self.send(b"\x1b[1;1R")
        return i

    def close(self) -> None:
        try:
            self.send(b"\x04")  # Ctrl-D on an empty line: leave
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)


def run_tty(args, env) -> tuple[float, int, int]:
    """-> (tok/s, completion tokens, terminal reads during the reply)"""
    t = Pty(cli(args), env)
    try:
        at = t.read_until(PROMPT, 0, args.load_timeout) + len(PROMPT)
        t.send(args.message.encode() + b"\r")
        at = t.read_until(ACCEPTED, at, 30) + len(ACCEPTED)  # prompt-toolkit is done with the input line
        reads = t.reads
        at = t.read_until(PROMPT, at, args.reply_timeout)  # the next prompt: the reply has ended
        reads = t.reads - reads
        t.send(b"/stats\r")
        t.read_until(b"session:", at, 30)
        m = STATS.search(ANSI.sub(b"", t.buf[at:]).decode(errors="replace"))
        if not m:
            raise RuntimeError("no /stats line on the screen")
        return float(m[3]), int(m[1]), reads
    finally:
        t.close()


def run_piped(args, env) -> tuple[float, int]:
    r = subprocess.run(cli(args), input=f"{args.message}\n/stats\n", capture_output=True, text=True, env=env,
                       timeout=args.load_timeout + args.reply_timeout, start_new_session=True, preexec_fn=_renice)
    m = STATS.search(r.stdout)
    if r.returncode or not m:
        raise RuntimeError(f"piped chat failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return float(m[3]), int(m[1])


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over `seconds` (from /proc/stat; 0 where there is none)."""
    def sample():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return 0, 0
        return v[3] + v[4], sum(v[:8])  # idle + iowait, total
    i0, t0 = sample()
    time.sleep(seconds)
    i1, t1 = sample()
    return 1 - (i1 - i0) / (t1 - t0) if t1 > t0 else 0.0


def wait_idle(limit: float, most: float = 0.1) -> float:
    """Wait (up to `limit` seconds) until at most `most` of the CPUs are busy -> the last reading."""
    deadline = time.monotonic() + limit
    while (busy := cpu_busy()) > most and time.monotonic() < deadline:
        pass
    return busy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="MODEL argument of `localllm chat` (default: the embedded one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=256, help="max tokens per reply")
    ap.add_argument("--threads", type=int, default=None, help="--threads of `localllm chat`")
    ap.add_argument("--chat-args", default="", help="more options of `localllm chat`, e.g. '--eager'")
    ap.add_argument("--cmd", default=None, help="how to start localllm (default: this virtualenv's `localllm`)")
    ap.add_argument("--message", default="Tell me a story")
    ap.add_argument("--modes", default="tty,piped")
    ap.add_argument("--code", action="append", default=[], metavar="DIR",
                    help="measure the localllm package of this checkout (PYTHONPATH=DIR, same virtualenv); "
                         "repeat it to compare checkouts, their runs interleaved")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="on a shared machine: before each run, wait up to this long for the CPUs to be idle")
    ap.add_argument("--nice", type=int, default=None,
                    help="scheduling priority of the chats under test (-20: others' jobs on a shared machine "
                         "barely preempt them; negative values need root)")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--reply-timeout", type=float, default=300)
    args = ap.parse_args()
    global NICE
    NICE = args.nice
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still close the chat under test
    env = {**os.environ, "TERM": os.environ.get("TERM", "xterm-256color")}
    env.pop("PROMPT_TOOLKIT_NO_CPR", None)
    codes = {os.path.basename(os.path.normpath(d)) or d: {**env, "PYTHONPATH": os.path.abspath(d)}
             for d in args.code} or {"": env}
    print(" ".join(cli(args)), file=sys.stderr)
    modes = args.modes.split(",")
    speeds: dict[tuple[str, str], list[float]] = {(c, m): [] for c in codes for m in modes}
    for i in range(args.runs):  # interleaved, so that load from elsewhere hits every figure alike
        for code, cenv in codes.items():
            for mode in modes:
                busy = wait_idle(args.wait_idle) if args.wait_idle else None
                if mode == "tty":
                    tps, n, reads = run_tty(args, cenv)
                    detail = f"{n} tokens, {reads} terminal chunks"
                else:
                    tps, n = run_piped(args, cenv)
                    detail = f"{n} tokens"
                if busy is not None:
                    detail += f", CPUs {busy:.0%} busy before"
                print(f"  {code} {mode:5s} run {i + 1}: {tps:6.1f} tok/s  ({detail})", file=sys.stderr)
                speeds[code, mode].append(tps)
    for code in codes:
        med = {m: statistics.median(speeds[code, m]) for m in modes}
        print((f"{code}: " if code else "") + "  ".join(f"{m}: {v:.1f} tok/s" for m, v in med.items())
              + (f"  (tty/piped {med['tty'] / med['piped']:.2f})" if {"tty", "piped"} <= set(med) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
