"""The suite leaves nothing behind in the temp dir (CI once failed on a full disk).

Every run used to leave its sandbox ($HOME, caches: a converted real model, ~0.5 GB) and what
the code under test keeps in $TMPDIR (a killed eval's workdir, outputs rescued from a full
disk) in /tmp; with pytest's default retention the last three runs' checkpoints stayed too.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).parent
# A real test that keeps a file in $TMPDIR on purpose: a rescued output (`outputs.rescue`).
RESCUING = "test_faults_write_fail.py::test_data_dump_to_a_250_byte_name_and_to_a_full_disk"


def test_a_passing_run_leaves_nothing_in_the_temp_dir(tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    inherited = ("AGENTREFINE_TEST_SANDBOX", "PYTEST_DEBUG_TEMPROOT")  # as a fresh shell has them
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env["TMPDIR"] = str(temp)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / RESCUING)],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout
    left = sorted(str(p.relative_to(temp)) for p in temp.rglob("*"))
    # pytest's per-user root (`pytest-of-USER`) may stay, empty: later runs share it.
    assert all(name.startswith("pytest-of-") and os.sep not in name for name in left), left
