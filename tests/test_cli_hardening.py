"""The CLI against bad input (issue #19), through the real executable: one line on stderr and a
non-zero exit for every mistake, never a traceback; nothing asked of the machine that it lacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXE = [sys.executable, "-m", "localllm.cli"]


def cli(*args, stdin: bytes = b"", timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*EXE, *args], input=stdin, capture_output=True, timeout=timeout, env=env)


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert r.stdout == b"" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    (["run", "--seed", str(2 ** 70), "hi"], "--seed"),
    (["chat", "--seed", str(-(2 ** 64)), "hi"], "--seed"),
    (["run", "--threads", "-1", "hi"], "--threads"),
    (["run", "--threads", "0", "hi"], "--threads"),
    (["run", "--ctx", "0", "hi"], "--ctx"),
    (["bench", "--threads", "0"], "--threads"),
    (["run", "--kv-memory", "nan", "hi"], "--kv-memory"),
    (["run", "--kv-memory", "inf", "hi"], "--kv-memory"),
    (["run", "--kv-memory", "0", "hi"], "--kv-memory"),
    (["run", "--max-memory", "0", "hi"], "--max-memory"),
    (["run", "--max-memory", "8 parsecs", "hi"], "--max-memory"),
    (["serve", "--kv-memory", "nan"], "--kv-memory"),
    (["serve", "--log-level", "bogus"], "--log-level"),
    (["serve", "--max-body-mb", "0"], "--max-body-mb"),
    (["serve", "--api-key", ""], "--api-key is empty"),
    (["serve", "--api-key", "secret "], "whitespace"),
    (["serve", "--api-key", "s\u00e9cret"], "printable ASCII"),
])
def test_bad_values_are_one_line_errors(args, needle):
    assert_one_line_error(cli(*args), 2, needle)


def test_memory_beyond_the_machine_is_refused_up_front():
    line = assert_one_line_error(cli("run", "--kv-memory", "1e9", "-n", "4", "hi"), 1, "--kv-memory")
    assert "1000000000.00 GiB is more than the" in line and "GiB of free RAM" in line
    assert_one_line_error(cli("run", "--max-memory", "1e9", "hi"), 1, "--max-memory", "is more than the")
    # --dry-run counts the KV cache --kv-memory asks for, and refuses what does not fit with the figures
    line = assert_one_line_error(cli("run", "--dry-run", "--kv-memory", "100000"), 1, "KV 100000.00 GiB")
    assert "available" in line
    r = cli("run", "--dry-run", "--kv-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "KV 0.06 GiB" in r.stdout.decode() and "ctx 2896" in r.stdout.decode()  # what 64 MiB of KV holds (181 blocks)
    line = assert_one_line_error(cli("run", "--dry-run", "--kv-memory", "8MiB", "--ctx", "4096"), 1)
    assert "holds 336 tokens, less than one 4096-token context" in line


@pytest.mark.parametrize("size,shown", [("512MiB", "only 0.50 GiB available"), ("0.75", "0.75 GiB available"),
                                        ("2G", "2.00 GiB available"), ("2GB", "1.86 GiB available"),
                                        ("1536 MiB", "1.50 GiB available")])
def test_max_memory_takes_units(size, shown):
    r = cli("run", "--dry-run", "--max-memory", size)  # 512 MiB is too little for the default model
    assert r.returncode == (1 if "only" in shown else 0), r.stderr
    assert shown in (r.stdout + r.stderr).decode() and b"Traceback" not in r.stderr


def test_invalid_utf8_in_argv_or_stdin_is_refused():
    assert_one_line_error(cli("run", b"caf\xe9"), 2, "argument 2 is not UTF-8 text (byte 0xe9)")
    assert_one_line_error(cli("chat", "--system", b"\xff\xfe"), 2, "argument 3 is not UTF-8 text (byte 0xff)")
    assert_one_line_error(cli("run", stdin=b"hello \xff\xfe\x00 world"), 2,
                          "stdin is not UTF-8 text (byte 0xff at offset 6)")


def test_a_path_that_is_no_model_is_an_error(tmp_path):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    assert_one_line_error(cli("run", str(empty), "hello"), 1, str(empty), "a directory without config.json")
    assert_one_line_error(cli("run", str(tmp_path / "missing"), "hello"), 1, "no such file or directory")
    assert_one_line_error(cli("run", "./not-here/model", "hello"), 1, "no such file or directory")


def test_chat_session_survives_bad_settings_and_bad_lines():
    stdin = (b"/set seed " + str(10 ** 30).encode() + b"\n" + b"/set temperature nan\n" + b"bad \xff line\n"
             + b"Say hi\n/show\n")
    r = cli("chat", "-n", "2", "--temperature", "0", "--enforce-eager", stdin=stdin)
    err, out = r.stderr.decode(), r.stdout.decode()
    assert r.returncode == 0, err
    assert "Traceback" not in err
    assert "invalid value for seed: seed: must be in -2^63..2^64-1" in err
    assert "invalid value for temperature" in err
    assert "input line 3 is not UTF-8 text (byte 0xff at offset 4); skipped" in err
    assert "seed: None" in out and "temperature: 0.0" in out  # the refused values were not kept
    assert "messages: 2" in out  # the one good message and its reply


def test_output_pipe_closed_early_exits_quietly():
    """`localllm run ... | head -c 20`: no traceback, exit 0 or 141 (SIGPIPE's), never 1."""
    p = subprocess.Popen([*EXE, "run", "--enforce-eager", "--temperature", "0", "-n", "300",
                          "Write a long story about a dragon."], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        head = p.stdout.read(20)
        p.stdout.close()  # what head does after 20 bytes
        err = p.stderr.read().decode()
        rc = p.wait(120)
    finally:
        p.kill()
    assert len(head) == 20
    assert rc in (0, 141) and err == "", (rc, err)


def test_exposure_warning_rules():
    from localllm.cli import exposure_warning

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert exposure_warning(host, None) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert "without an API key" in exposure_warning(host, None), host
        assert exposure_warning(host, "k") is None


def test_serve_beyond_loopback_without_a_key_warns():
    """Not a network test: 192.0.2.1 (TEST-NET-1) is no address of this machine, so binding fails
    after the warning was printed."""
    from server_proc import free_port

    r = cli("serve", "--host", "192.0.2.1", "--port", str(free_port()), "--enforce-eager", timeout=120)
    err = r.stderr.decode()
    assert r.returncode != 0, err  # uvicorn's startup failure (3)
    assert "WARNING: listening on 192.0.2.1 without an API key" in err and "Traceback" not in err


def test_engine_config_refuses_zero_instead_of_reading_it_as_default():
    from localllm.config import EngineConfig

    for name in ("max_model_len", "kv_memory_bytes", "num_threads", "num_kv_blocks"):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=f"EngineConfig.{name} must be a positive integer"):
                EngineConfig(**{name: bad})
        assert getattr(EngineConfig(**{name: 3}), name) == 3
