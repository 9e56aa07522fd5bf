"""The test suite cleans up after itself: each pytest process's LOCALLLM_HOME (conftest.py makes one
at import, and the conversion caches and compiled packages of a run land there) is removed when
its session ends, so repeated runs do not fill /tmp."""

import os
import subprocess
import sys
from pathlib import Path

CHILD = '''
import os
from pathlib import Path


def test_records_its_home():
    home = Path(os.environ["LOCALLLM_HOME"])
    (home / "converted").mkdir()
    (home / "converted" / "x.safetensors").write_bytes(b"0" * 1024)
    Path(os.environ["REPORT"]).write_text(str(home))
'''


def test_a_sessions_home_is_removed_when_it_ends(tmp_path):
    (tmp_path / "test_child.py").write_text(CHILD)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    report = tmp_path / "home.txt"
    env = {**os.environ, "TMPDIR": str(tmp), "REPORT": str(report),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_child.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    home = Path(report.read_text())
    assert home.parent == tmp and home.name.startswith("localllm-test-home-")  # it was made, there
    assert not home.exists()
    assert not list(tmp.glob("localllm-test-home-*"))
