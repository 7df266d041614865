"""Fresh virtualenvs for tests that must see the project the way a user's machine would.

`--system-site-packages` is not enough: run from inside a virtualenv it exposes the *base*
interpreter's packages, not the ones installed in that virtualenv. A .pth file listing this
interpreter's import path works for a plain interpreter and a venv alike.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys


def venv_seeing_this_interpreter(
    dest: pathlib.Path, *, extra: tuple[str, ...] = (), hide_project: bool = False
):
    """A venv at `dest` whose python imports what this interpreter imports (plus `extra` first).

    With `hide_project`, import-path entries that hold an `agentrefine_jax` package are left out,
    so only what is installed into the venv itself provides the project. Returns its python.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    visible = [p for p in [*extra, *sys.path] if p and pathlib.Path(p).is_dir()]
    if hide_project:
        visible = [p for p in visible if not (pathlib.Path(p) / "agentrefine_jax").is_dir()]
    (pathlib.Path(site) / "outer_interpreter.pth").write_text("\n".join(visible) + "\n")
    return python
