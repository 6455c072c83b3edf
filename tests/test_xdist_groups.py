"""`make test`'s `--dist loadgroup` keeps the tests of one ``xdist_group`` on one worker: the
SLURM tests share one cluster, and modules whose tests share an expensive fixture make it once.
(pytest 9.2 with pytest-xdist 3.8 silently stopped grouping: pyproject.toml pins pytest 9.1.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

GROUPED = '''
import os, time, pytest
pytestmark = pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    time.sleep(0.2)
    print(os.environ["PYTEST_XDIST_WORKER"])
'''
FREE = '''
import time, pytest
@pytest.mark.parametrize("i", range(4))
def test_free(i):
    time.sleep(0.2)
'''


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_free.py").write_text(FREE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    workers = {test: worker for worker, test in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (\S+)", done.stdout)}
    grouped = {w for t, w in workers.items() if "test_grouped" in t}
    assert len([t for t in workers if "test_grouped" in t]) == 4 and len(grouped) == 1, done.stdout[-3000:]
