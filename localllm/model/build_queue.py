"""The background build queue of the compiled step: one builder per localllm home, jobs in a folder.

Why a queue: every model an engine touched used to start its own builder, and eight models tried
in a row ran eight builders at once (6.4 GB of RSS together), long after the commands had exited.
Now an engine that wants a package writes a job file into <cache>/aoti/queue and makes sure one
builder runs; the builder takes the jobs one at a time, each in a fresh worker process (so memory
goes back between models: one model loaded at a time), and exits when the queue is empty.

Processes (all in our session; `localllm ps` lists them, `localllm ps --stop` ends them):
  the builder: `python -c <boot> builder HOME`, stdlib only (no torch: ~10 MB), holds
    <cache>/aoti/builder.lock (a second one exits before importing anything), runs the jobs;
  its worker: `python -m localllm.model.compiled JOB`, at SCHED_IDLE, in a process group of its
    own, killed with the builder (PR_SET_PDEATHSIG); it loads the model and builds its packages.

A build never slows an answer: every engine with a compiled step holds a shared lock on
<cache>/aoti/busy.lock while it generates and stops the worker's group (SIGSTOP) when it starts;
the builder continues the worker only once no engine holds that lock (checked every 50 ms), so
a killed engine, whose lock the kernel releases, cannot leave the build stopped.

This module imports no torch: `localllm ps`, `rm` and the builder itself stay light.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import cache_home

POLL_S = 0.05  # how often the builder looks at the busy lock while its worker runs


def aoti_dir() -> Path:
    return cache_home() / "aoti"


def queue_dir() -> Path:
    return aoti_dir() / "queue"


def _state_path() -> Path:
    return aoti_dir() / "builder.json"


# ---- jobs ---------------------------------------------------------------------------------------
@dataclass
class Job:
    key: str
    path: Path
    spec: dict  # {"origin": load_model's arguments, "kv_dtype", "threads", "queued"}

    @property
    def model(self) -> str:
        return self.spec["origin"]["path"]


def enqueue(key: str, spec: dict) -> Path:
    """Put a job in the queue (atomically; a job already queued under `key` keeps its place)."""
    q = queue_dir()
    q.mkdir(parents=True, exist_ok=True)
    path = q / f"{key}.json"
    if not path.exists():
        tmp = q / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**spec, "queued": time.time()}))
        os.replace(tmp, path)
    return path


def jobs() -> list[Job]:
    """Queued jobs, oldest first (the one being built included)."""
    out = []
    for p in queue_dir().glob("*.json") if queue_dir().is_dir() else []:
        try:
            spec = json.loads(p.read_text())
            out.append(Job(p.stem, p, spec))
        except (OSError, ValueError):  # removed meanwhile, or not ours
            continue
    return sorted(out, key=lambda j: (j.spec.get("queued", 0), j.key))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# ---- the builder --------------------------------------------------------------------------------
# Runs as `python -c BOOT builder HOME`: the lock is taken before anything is imported, so a
# second builder started by a race costs a bare interpreter for a few milliseconds. Not niced:
# it mostly sleeps, and must stop and continue the (SCHED_IDLE) worker promptly on a busy machine.
_BOOT = """import fcntl, os, sys
lock = os.path.join(sys.argv[2], 'builder.lock')
fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    sys.exit(0)
from localllm.model.build_queue import _builder_main
sys.exit(_builder_main(fd))
"""


def builder_pid() -> int | None:
    """The pid of the running builder, if any (it holds builder.lock)."""
    lock = aoti_dir() / "builder.lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError:
        try:
            return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
        except ValueError:
            return None
    finally:
        os.close(fd)


def ensure_builder() -> subprocess.Popen | None:
    """Start the builder unless one runs. -> the process started, or None."""
    if builder_pid() is not None or not jobs():
        return None
    d = aoti_dir()
    d.mkdir(parents=True, exist_ok=True)
    return spawn_in_group([sys.executable, "-c", _BOOT, "builder", str(d)], d / "build.log")


def spawn_in_group(argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start argv in a process group of its own (same session), output appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(log_path, "ab") as logf:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, close_fds=True, **group)


# the worker: idle priority before anything starts a thread (importing torch starts OpenMP's;
# threads inherit the policy of the thread that creates them); killed when the builder dies;
# SIGHUP ignored (were its group orphaned while stopped, the kernel sends SIGHUP, then SIGCONT)
_WORKER_BOOT = """import ctypes, os, runpy, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_IGN)
try: ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError): pass
try: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError): os.nice(19)
sys.argv = ['localllm.model.compiled', sys.argv[1]]
runpy.run_module('localllm.model.compiled', run_name='__main__', alter_sys=True)
"""


def spawn_worker(job_path: Path, log_path: Path) -> subprocess.Popen:
    """One worker for one job (the builder's, or a test's stand-in for it)."""
    return spawn_in_group([sys.executable, "-c", _WORKER_BOOT, str(job_path)], log_path)


def _write_state(state: dict | None) -> None:
    path = _state_path()
    if state is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".builder.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def read_state() -> dict | None:
    """What the builder is doing: {"pid", "started", "worker", "job", "model", "since"}; None
    when no builder runs."""
    pid = builder_pid()
    if pid is None:
        return None
    try:
        state = json.loads(_state_path().read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("pid") != pid:  # written by an earlier builder, or not yet by this one
        state = {"pid": pid}
    return state


def _builder_main(lock_fd: int) -> int:
    """Take the queued jobs one at a time, then exit. Holds builder.lock (lock_fd) throughout."""
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
    busy_fd = os.open(aoti_dir() / "busy.lock", os.O_RDWR | os.O_CREAT, 0o644)
    started = time.time()
    while True:
        queued = jobs()
        if not queued:
            # release, then look again: a job queued after our last look, while we still held the
            # lock, saw a builder running and started none
            _write_state(None)
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            if not jobs():
                return 0
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return 0  # another builder took over
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
            continue
        job = queued[0]
        t0 = time.time()
        worker = spawn_worker(job.path, aoti_dir() / "build.log")
        _write_state({"pid": os.getpid(), "started": started, "worker": worker.pid, "job": job.key,
                      "model": job.model, "since": t0})
        while worker.poll() is None:
            _pause_while_busy(worker.pid, busy_fd)
            time.sleep(POLL_S)
        job.path.unlink(missing_ok=True)  # done, failed (logged by the worker) or removed by rm
        if worker.returncode:
            print(f"{time.strftime('%F %T')} build of {job.model} ended with {worker.returncode} "
                  f"after {time.time() - t0:.0f} s", flush=True)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _pause_while_busy(worker: int, busy_fd: int) -> None:
    """Stop the worker's group while any engine holds busy.lock, continue it when none does."""
    try:
        fcntl.flock(busy_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(busy_fd, fcntl.LOCK_UN)
        busy = False
    except OSError:
        busy = True
    stopped = _proc_state(worker) == "T"
    if busy != stopped:
        try:
            os.killpg(worker, signal.SIGSTOP if busy else signal.SIGCONT)
        except OSError:  # it ended meanwhile
            pass


# ---- what engines do ----------------------------------------------------------------------------
class BusyFlag:
    """An engine's "I am generating" for the builder: a shared lock on busy.lock while busy."""

    def __init__(self):
        self._fd: int | None = None

    def set(self, busy: bool) -> None:
        if busy and self._fd is None:
            aoti_dir().mkdir(parents=True, exist_ok=True)
            self._fd = os.open(aoti_dir() / "busy.lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # waits at most for another engine's check below
            self._signal_worker(signal.SIGSTOP)  # now, not at the builder's next look
        elif not busy and self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            try:  # nobody else busy: continue it now (holding the lock, so nobody starts meanwhile)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._signal_worker(signal.SIGCONT)
            except OSError:
                pass
            os.close(fd)

    @staticmethod
    def _signal_worker(sig: int) -> None:
        try:
            worker = json.loads(_state_path().read_text()).get("worker")
            if worker:
                os.killpg(worker, sig)
        except (OSError, ValueError, AttributeError):  # no builder, or it moved on
            pass


# ---- what the user sees: `localllm ps`, `ps --stop`, `rm` ----------------------------------------
def _tree_rss(pid: int) -> int:
    """RSS in bytes of `pid` and its descendants (the worker's compiler processes)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def status() -> list[dict]:
    """One row per job: {"model", "state" (building | paused | waiting | queued), "pid", "rss",
    "age"} (pid and rss: the builder's whole tree, on the job it is building); a builder between
    jobs shows as a row of its own with model None."""
    now, rows = time.time(), []
    state = read_state()
    current = state.get("job") if state else None
    worker = state.get("worker") if state else None
    for job in jobs():
        row = {"model": job.model, "state": "queued", "pid": None, "rss": None,
               "age": now - job.spec.get("queued", now), "job": job.key}
        if job.key == current and worker:
            row.update(state="paused" if _proc_state(worker) == "T" else "building", pid=state["pid"],
                       worker=worker, rss=_tree_rss(state["pid"]), age=now - state.get("since", now))
        rows.append(row)
    if state and not any(r["pid"] for r in rows):
        rows.insert(0, {"model": None, "state": "starting", "pid": state["pid"], "rss": _tree_rss(state["pid"]),
                        "age": now - state.get("started", now), "job": None})
    return rows


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # SIGKILL: it may be stopped (a SIGTERM would wait for SIGCONT)
    except OSError:
        pass


def stop_all() -> int:
    """End the builder and its worker and empty the queue (`localllm ps --stop`). -> jobs dropped."""
    queued = jobs()
    for job in queued:
        job.path.unlink(missing_ok=True)
    state = read_state()
    if state:
        if state.get("worker"):
            _kill_group(state["worker"])
        _kill_group(state["pid"])
        _wait_gone(state["pid"])
        if state.get("worker"):
            _wait_gone(state["worker"])
        _write_state(None)
    return len(queued)


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _proc_state(pid) not in ("?", "Z"):
        time.sleep(0.02)


def remove_jobs(source: str | os.PathLike) -> int:
    """Drop the queued jobs of the model file(s) under `source` and stop its build if it is the
    one running (`localllm rm`). -> jobs dropped."""
    root, count = str(Path(source).resolve()), 0
    state = read_state()
    for job in jobs():
        if _under(job.model, root):
            job.path.unlink(missing_ok=True)
            count += 1
            if state and state.get("job") == job.key and state.get("worker"):
                _kill_group(state["worker"])  # the builder goes on with the next job
                _wait_gone(state["worker"])
    return count
