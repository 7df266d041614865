"""`--overwrite` replaces only bytes this project wrote (issue 32, item 3), and every output file's
mode follows the umask (item 7): real `export to-hf` processes on real directories.

* a user's edit to a file the marker lists (a field added to `config.json`) is refused in one
  line naming the file, and kept (it was silently destroyed, exit 0);
* a marker of an earlier version (names, not contents) is refused safely: it cannot prove that
  no file was edited;
* under umask 027 every exported file is 0640 (`model.safetensors` was 0600, its siblings 0644).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest
from faults_disk import env, one_line, run, snapshot
from test_eval_checkpoint import save_random_checkpoint

from agentrefine_jax.models.config import preset
from agentrefine_jax.outputs import MARKER


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """A checkpoint and its export, written under umask 027."""
    root = tmp_path_factory.mktemp("ckpt")
    ckpt = pathlib.Path(
        save_random_checkpoint(root / "run", preset("tiny", max_position_embeddings=256), seed=0)
    )
    out = root / "hf"
    umask = ["sh", "-c", 'umask 027 && exec "$@"', "sh", sys.executable, "-m", "agentrefine_jax.export"]
    res = subprocess.run(
        [*umask, "to-hf", "--checkpoint", str(ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env(),
    )
    assert res.returncode == 0, res.stderr
    return ckpt, out


def test_every_exported_file_follows_the_umask(exported):
    _, out = exported
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def _overwrite(ckpt: pathlib.Path, out: pathlib.Path):
    return run("export", "to-hf", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite")


def test_overwrite_refuses_a_file_edited_since_and_an_old_marker(exported, tmp_path):
    ckpt, original = exported
    out = tmp_path / "hf"
    shutil.copytree(original, out)  # an export of ours, then a user's edit to a listed file
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "my_field": 1}))
    before = snapshot(tmp_path)
    one_line(_overwrite(ckpt, out), "export", 2, "config.json", "changed since")
    assert snapshot(tmp_path) == before

    marker = json.loads((out / MARKER).read_text())
    old = {"written_by": marker["written_by"], "entries": marker["entries"]}  # names only
    (out / MARKER).write_text(json.dumps(old))
    before = snapshot(tmp_path)
    one_line(_overwrite(ckpt, out), "export", 2, "older", MARKER)
    assert snapshot(tmp_path) == before

    (out / MARKER).write_text(json.dumps(marker))
    (out / "config.json").write_bytes((original / "config.json").read_bytes())  # as we wrote it
    res = _overwrite(ckpt, out)
    assert res.returncode == 0, res.stderr  # unchanged since: replaced
    assert json.loads((out / MARKER).read_text())["files"]["model.safetensors"]["size"] > 0


def test_overwrite_on_gcs_refuses_an_edited_object(exported, gcs_emulator):
    ckpt, _ = exported
    bucket = "faults-overwrite"
    gcs_emulator.create_bucket(bucket)
    out = f"gs://{bucket}/hf"

    def export(*extra: str):
        cmd = ["to-hf", "--checkpoint", str(ckpt), "--out", out, *extra]
        return run("export", *cmd, env=gcs_emulator.env(env()))

    first = export()
    assert first.returncode == 0, first.stderr
    config = gcs_emulator.read(bucket, "hf/config.json")
    gcs_emulator.write(bucket, "hf/config.json", config.rstrip(b"}\n") + b', "my_field": 1}')
    edited = gcs_emulator.objects(bucket, "hf/")
    one_line(export("--overwrite"), "export", 2, "config.json", "changed since")
    assert gcs_emulator.objects(bucket, "hf/") == edited
    gcs_emulator.write(bucket, "hf/config.json", config)
    again = export("--overwrite")
    assert again.returncode == 0, again.stderr
