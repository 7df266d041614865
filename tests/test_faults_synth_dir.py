"""`synth generate --out DIR` under hostile conditions (issue 32, item 1; SIGTERM of item 7):
real `python -m agentrefine_jax.synth generate` processes against a loopback replay server.

* a user's directory (their `trajectories.jsonl`, last row complete but without a newline) is
  refused in one line and left byte for byte as it was (it lost that row, and got `state/` and
  `summary.json`, before);
* a symlinked --out is refused (it was written through);
* in the generator's own directory a last row without a newline that *is* valid JSON is kept
  and its newline added (it was deleted as "torn");
* a second generator on a busy --out is refused while the first lives (both ran: duplicates,
  paid calls twice); SIGTERM stops the first with exit 75 and one line (it was 143, no word),
  and the next run resumes with nothing duplicated;
* a disk that fills up mid-run ends in one line, exit 1, no thread traceback (four before),
  and every row written before is whole.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from faults_disk import NOISE, env, one_line, run, small_disk, snapshot
from test_synth_common import FRESH_STAGE, SCRIPT_STAGE, good_turns, read_jsonl, reply, script_reply

from agentrefine_jax.synth.replay_server import ReplayServer

KEY = {"OPENAI_API_KEY": "sk-faults-synth"}


def _rules(hold: str | None = None) -> list[dict]:
    rules = []
    if hold:  # the persona whose trajectory request hangs until the server stops
        rules.append({"name": "hold", "match": [hold, FRESH_STAGE], "replies": [{"hang": True}]})
    return rules + [
        {"name": "script", "match": [SCRIPT_STAGE], "replies": [script_reply()], "repeat_last": True},
        {
            "name": "fresh",
            "match": [FRESH_STAGE],
            "replies": [reply({"turns": good_turns()})],
            "repeat_last": True,
        },
    ]


def _personas(tmp_path, names: list[str]):
    path = tmp_path / "personas.jsonl"
    path.write_text("".join(json.dumps({"id": n.lower(), "persona": f"{n}, a cook."}) + "\n" for n in names))
    return path


def _args(server, personas, out, *extra: str) -> list[str]:
    return [
        "generate", "--personas", str(personas), "--out", str(out), "--base-url", server.url,
        "--model", "m", "--concurrency", "2", "--backoff-base", "0.001", "--backoff-max", "0.01",
        "--timeout", "60", "--progress-interval", "0.2", *extra,
    ]  # fmt: skip


def _generate(server, personas, out, *extra: str) -> subprocess.CompletedProcess:
    return run("synth", *_args(server, personas, out, *extra), env=env(**KEY))


def test_a_users_directory_and_a_symlinked_out_are_refused_untouched(tmp_path):
    personas = _personas(tmp_path, ["FA-P1"])
    mine = tmp_path / "mine"
    mine.mkdir()
    row = {"id": "fa-p1", "persona": "FA-P1, a cook.", "turns": good_turns()}
    (mine / "trajectories.jsonl").write_text(json.dumps({"id": "x"}) + "\n" + json.dumps(row))  # no final \n
    (tmp_path / "link").symlink_to(mine, target_is_directory=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link-to-empty").symlink_to(empty, target_is_directory=True)
    before = snapshot(tmp_path)
    with ReplayServer(_rules()) as server:
        for out, needle in (
            (mine, "did not make"),
            (tmp_path / "link", "symbolic link"),
            (tmp_path / "link-to-empty", "symbolic link"),
        ):
            one_line(_generate(server, personas, out), "synth", 2, str(out), needle)
        assert server.requests == []  # refused before any paid call
    assert snapshot(tmp_path) == before


def test_own_directory_keeps_a_whole_last_row_without_newline(tmp_path):
    personas = _personas(tmp_path, ["FB-P1", "FB-P2"])
    out = tmp_path / "out"
    with ReplayServer(_rules()) as server:
        first = _generate(server, personas, out)
        assert first.returncode == 0, first.stderr
        results = out / "trajectories.jsonl"
        results.write_bytes(results.read_bytes().rstrip(b"\n"))  # a whole row, newline missing
        n = len(server.requests)
        more = _personas(tmp_path, ["FB-P1", "FB-P2", "FB-P3"])
        second = _generate(server, more, out)
        assert second.returncode == 0, second.stderr
        assert "added one (row kept)" in second.stderr and "torn" not in second.stderr
        assert all("FB-P3" in r["text"] for r in server.requests[n:])  # nothing paid for twice
    assert sorted(r["id"] for r in read_jsonl(results)) == ["fb-p1", "fb-p2", "fb-p3"]
    assert results.read_bytes().endswith(b"\n")


def _wait(cond, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out; stderr:\n{proc.communicate()[1]}")


def test_one_generator_per_out_and_sigterm_is_75_with_one_line(tmp_path):
    names = [f"FC-P{i}" for i in range(1, 5)]
    personas = _personas(tmp_path, names)
    out = tmp_path / "out"
    with ReplayServer(_rules(hold="FC-P4")) as server:
        cmd = [sys.executable, "-m", "agentrefine_jax.synth", *_args(server, personas, out)]
        first = subprocess.Popen(
            cmd, env=env(**KEY), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        results = out / "trajectories.jsonl"

        def held() -> bool:  # FC-P4's trajectory request reached the server (it hangs there)
            return any("FC-P4" in r["text"] and FRESH_STAGE in r["text"] for r in list(server.requests))

        # Both: the first generator's last paid call may still be on its way after the third row.
        _wait(lambda: results.exists() and len(read_jsonl(results)) == 3 and held(), first)
        n = len(server.requests)
        second = _generate(server, personas, out)
        one_line(second, "synth", 2, "in use by another synth generate", f"pid {first.pid}")
        assert len(server.requests) == n  # the second paid for nothing
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
        assert first.returncode == 75, err
        assert not any(x in err for x in NOISE), err
        assert [ln for ln in err.splitlines() if "SIGTERM" in ln][-1].startswith(
            "[synth] terminated (SIGTERM)"
        )
        assert not (out / "synth.lock").exists()  # released on the way out
    with ReplayServer(_rules()) as server:
        third = _generate(server, personas, out)
        assert third.returncode == 0, third.stderr
        assert all("FC-P4" in r["text"] for r in server.requests)
    assert sorted(r["id"] for r in read_jsonl(results)) == [n.lower() for n in names]


def test_a_full_disk_is_one_line_and_no_thread_traceback(tmp_path):
    names = [f"FD-P{i}" for i in range(1, 41)]  # ~6 KB a row: more than the 64 KB disk holds
    personas = _personas(tmp_path, names)
    with small_disk("64k") as disk, ReplayServer(_rules()) as server:
        out = disk / "out"
        res = _generate(server, personas, out, "--concurrency", "4")
        line = one_line(res, "synth", 1, "No space left on device")
        assert "could not write" in line
        rows = (out / "trajectories.jsonl").read_text().splitlines()
        assert rows and all(json.loads(r)["id"].startswith("fd-p") for r in rows)  # every row whole
        assert len(rows) < len(names)
        assert not os.path.exists(out / "synth.lock")


def test_a_full_disk_names_where_every_rescued_row_went(tmp_path):
    """Issue 44: each row that could not be appended was rescued into a directory of its own (and the
    summary and state files into others); the last line named one of them."""
    names = [f"FR-P{i}" for i in range(1, 41)]
    personas = _personas(tmp_path, names)
    temp = tmp_path / "temp"  # the child's $TMPDIR: every rescued file of this run lands under it
    temp.mkdir()
    with small_disk("64k") as disk, ReplayServer(_rules()) as server:
        out = disk / "out"
        res = run(
            "synth", *_args(server, personas, out, "--concurrency", "4"), env=env(TMPDIR=str(temp), **KEY)
        )
        line = one_line(res, "synth", 1, "No space left on device")
        rescued = sorted(p for p in temp.rglob("*") if p.is_file())
        homes = [next(d for d in p.parents if d.name.startswith("agentrefine-rescued-")) for p in rescued]
        told = [p for p, home in zip(rescued, homes, strict=True) if str(home) in line]
        assert rescued and told == rescued, (line, rescued)  # every rescued file: the line says where
        kept = pathlib.Path(line.split("kept instead in ", 1)[1].split(":", 1)[0])
        assert all(p.is_relative_to(kept) for p in rescued)  # all in one place
        on_disk = {json.loads(r)["id"] for r in (out / "trajectories.jsonl").read_text().splitlines()}
        saved = kept / "trajectories.jsonl"
        rows = [json.loads(r) for r in saved.read_text().splitlines()] if saved.exists() else []
        assert f"{len(rows)} finished row(s) (trajectories.jsonl)" in line or not rows
        assert all(r["id"].startswith("fr-p") for r in rows)  # whole rows
        assert not on_disk & {r["id"] for r in rows}
