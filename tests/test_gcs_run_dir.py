"""`train.run_dir=gs://…` against a real GCS server (fake-gcs-server on 127.0.0.1, see
tests/gcs_emulator.py), through the real CLIs: Orbax/TensorStore write the arrays, etils/gcsfs
everything else, and only STORAGE_EMULATOR_HOST points them there.

One uninterrupted reference run (module scope; it trains while the interrupted run below does,
the two share the machine's cores) is checked object by object and exported to gs://;
`inference generate --checkpoint gs://…` decodes from it as transformers does from the export.
The interrupted run loses its storage mid-save (its emulator is killed), starts again once
storage is back, is hard-killed, and resumes — ending equal to the reference, step for step.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time
from subprocess import PIPE
from typing import Any

import pytest
from test_train_loop import _env

from agentrefine_jax.checkpoint import MANIFEST
from agentrefine_jax.outputs import MARKER
from agentrefine_jax.train.run_lock import LOCK_NAME

REPO = pathlib.Path(__file__).resolve().parent.parent
BUCKET = "agentrefine-test"
STEPS = 4
TRAIN_ARGS = [
    "--set", "data.max_length=256",
    "--set", "train.global_batch_size=2",
    "--set", f"train.max_steps={STEPS}",
    "--set", "train.checkpoint_every=2",
    "--set", "train.eval_every=0",
    "--set", "train.log_every=1",
]  # fmt: skip
TIMEOUT_S = 420


def _train(
    emulator, run: str, data: pathlib.Path, *extra: str, out: Any = subprocess.PIPE
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny", *TRAIN_ARGS]
    cmd += [
        "--set",
        f"data.train_files={json.dumps([str(data)])}",
        "--set",
        f"train.run_dir=gs://{BUCKET}/{run}",
    ]
    cmd += ["--set", f"train.export_hf_at_end=gs://{BUCKET}/{run}-hf"]
    return subprocess.Popen(
        [*cmd, *extra],
        cwd=REPO,
        env=emulator.env(_env(REPO)),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"run did not end within {TIMEOUT_S}s:\n{out}") from None
    return proc.returncode, out


def _wait_for(emulator, proc: subprocess.Popen, what: str, found) -> None:
    """Poll the bucket (bounded) until `found(objects)`; the run must still be going."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if found(emulator.objects(BUCKET)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {what}:\n{proc.communicate()[0]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {what} within {TIMEOUT_S}s")


def _rows(emulator, run: str) -> list[dict]:
    def reject(constant: str) -> None:
        raise AssertionError(f"metrics.jsonl holds the non-JSON constant {constant}")

    text = emulator.read(BUCKET, f"{run}/metrics.jsonl").decode()
    return [json.loads(line, parse_constant=reject) for line in text.splitlines()]


def _losses(emulator, run: str) -> dict[int, float]:
    rows = [r for r in _rows(emulator, run) if "loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def _one_error_line(out: str) -> str:
    for noise in ("Traceback", "Event loop is closed", "ERROR:absl", "ERROR:gcsfs"):
        assert noise not in out, out
    errors = [line for line in out.splitlines() if line.startswith("[train] error:")]
    assert len(errors) == 1, out
    return errors[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    """The demo's first 40 conversations: 20 steps an epoch, a tenth of the tokenizing."""
    from configs.tiny import DEMO_DATA

    path = tmp_path_factory.mktemp("gcs-data") / "train.jsonl"
    path.write_text("".join((DEMO_DATA / "train.jsonl").read_text().splitlines(keepends=True)[:40]))
    return path


PROMPT = [128000, 791, 6134, 374, 16447, 13]


class Reference:
    """The uninterrupted run, started at once; as soon as it ends, `inference generate` decodes
    from its gs:// checkpoint (both overlap the interrupted run's test, which needs no result)."""

    def __init__(self, emulator, data: pathlib.Path, log: pathlib.Path) -> None:
        self.log = log
        with open(log, "w") as f:  # a file, not a pipe: nobody reads while it trains
            self.proc = _train(emulator, "reference", data, out=f)
        self.generated: subprocess.CompletedProcess | BaseException | None = None
        self.gen_proc: subprocess.Popen | None = None
        self._generate = threading.Thread(target=self._then_generate, args=(emulator,), daemon=True)
        self._generate.start()

    def _then_generate(self, emulator) -> None:
        try:
            if self.proc.wait(timeout=TIMEOUT_S) != 0:
                return
            cmd = [sys.executable, "-m", "agentrefine_jax.inference", "generate"]
            cmd += ["--checkpoint", f"gs://{BUCKET}/reference", "--prompt-ids", ",".join(map(str, PROMPT))]
            cmd += ["--max-new-tokens", "8", "--greedy", "--no-stop-ids", "--dtype", "float32"]
            self.gen_proc = subprocess.Popen(
                cmd, cwd=REPO, env=emulator.env(_env(REPO)), stdout=PIPE, stderr=PIPE, text=True
            )
            out, err = self.gen_proc.communicate(timeout=TIMEOUT_S)
            self.generated = subprocess.CompletedProcess(cmd, self.gen_proc.returncode, out, err)
        except BaseException as e:  # noqa: BLE001 - reported by the test that reads it
            self.generated = e

    def stop(self) -> None:
        """Kill whatever still runs (a failed or interrupted module)."""
        for proc in (self.proc, self.gen_proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def wait(self) -> str:
        try:
            code = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"reference run did not end within {TIMEOUT_S}s") from None
        out = self.log.read_text()
        assert code == 0, out
        return out

    def generate(self) -> subprocess.CompletedProcess:
        self.wait()
        self._generate.join(timeout=TIMEOUT_S)
        assert isinstance(self.generated, subprocess.CompletedProcess), self.generated
        return self.generated


@pytest.fixture(scope="module")
def reference(gcs_emulator, data):
    gcs_emulator.create_bucket(BUCKET)
    ref = Reference(gcs_emulator, data, data.parent / "reference.log")
    try:
        yield ref
    finally:
        ref.stop()


@pytest.fixture
def own_emulator(tmp_path):
    """An emulator of its own, to kill without touching the reference run's."""
    from gcs_emulator import GcsEmulator

    emulator = GcsEmulator(tmp_path / "gcs")
    emulator.start()
    try:
        emulator.create_bucket(BUCKET)
        yield emulator
    finally:
        emulator.kill()


def test_storage_lost_mid_save_then_killed_then_resumed_equals_the_uninterrupted_run(
    own_emulator, gcs_emulator, reference, data
):
    run = "interrupted"
    # 1. Storage dies while the first checkpoint is being saved: one line, exit 1, at the next step.
    proc = _train(own_emulator, run, data)
    try:
        saving = f"{run}/checkpoints/2/"
        _wait_for(own_emulator, proc, "step 2 save", lambda o: any(n.startswith(saving) for n in o))
        own_emulator.kill()
        code, out = _finish(proc)
    finally:
        if not own_emulator.alive():
            own_emulator.start()  # same port, same objects: storage is back
    assert code == 1, out
    line = _one_error_line(out)
    assert "saving checkpoint step 2" in line and "the run stopped" in line, line
    assert max(_losses(own_emulator, run)) == 2  # stored before the save began; step 3 never counted

    # 2. Storage is back: the same command starts over (step 2 never completed) — taking over the
    #    lock object the stopped trainer could not remove (a create-if-absent write that failed
    #    because it exists) — and is hard-killed right after step 2's checkpoint is complete.
    lock = f"{run}/{LOCK_NAME}"
    proc = _train(own_emulator, run, data)
    _wait_for(own_emulator, proc, "step 2 manifest", lambda o: f"{run}/checkpoints/2/{MANIFEST}" in o)
    holder = json.loads(own_emulator.read(BUCKET, lock))
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate(timeout=60)[0]
    assert holder["pid"] == proc.pid, holder
    assert "took over the stale lock" in out, out  # (it resumes from step 2 only if Orbax had
    # committed step 2 before storage died: a kill between commit and manifest, also resumable)

    # 3. The same command resumes from step 2 and finishes, equal to the uninterrupted run.
    code, out = _finish(_train(own_emulator, run, data))
    assert code == 0, out
    assert f"resumed from gs://{BUCKET}/{run}/checkpoints/2" in out, out
    assert f"pid {proc.pid} on host" in out and lock not in own_emulator.objects(BUCKET), out
    reference.wait()
    assert _losses(own_emulator, run) == _losses(gcs_emulator, "reference")
    final = own_emulator.read(BUCKET, f"{run}-hf/model.safetensors")
    assert final == gcs_emulator.read(BUCKET, "reference-hf/model.safetensors")


def test_run_dir_on_gcs_holds_checkpoints_metrics_tensorboard_and_export(gcs_emulator, reference):
    reference.wait()
    objects = gcs_emulator.objects(BUCKET, "reference/")
    steps = sorted({int(n.split("/")[2]) for n in objects if n.startswith("reference/checkpoints/")})
    assert steps == [2, 4], steps
    assert f"reference/{LOCK_NAME}" not in objects  # the run's lock object, removed at exit
    for step in steps:  # every file of a step is in its manifest, with its size and sha256
        prefix = f"reference/checkpoints/{step}/"
        manifest = json.loads(gcs_emulator.read(BUCKET, prefix + MANIFEST))["files"]
        stored = {n[len(prefix) :]: size for n, size in objects.items() if n.startswith(prefix)}
        stored.pop(MANIFEST)
        assert {rel: rec["size"] for rel, rec in manifest.items()} == stored
        for rel, rec in manifest.items():
            assert hashlib.sha256(gcs_emulator.read(BUCKET, prefix + rel)).hexdigest() == rec["sha256"]
    assert sorted(_losses(gcs_emulator, "reference")) == list(range(1, STEPS + 1))
    assert json.loads(gcs_emulator.read(BUCKET, "reference/config.json"))["train"]["max_steps"] == STEPS
    events = [n for n in objects if n.startswith("reference/tensorboard/events.out.tfevents")]
    assert len(events) == 1 and b"loss" in gcs_emulator.read(BUCKET, events[0])
    export = set(gcs_emulator.objects(BUCKET, "reference-hf/"))
    # written as every project output is: marked as this project's (what --overwrite may replace)
    assert {f"reference-hf/{f}" for f in ("config.json", "model.safetensors", MARKER)} <= export, export


def test_generate_from_a_gcs_checkpoint_matches_transformers_on_the_export(gcs_emulator, reference, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    proc = reference.generate()  # `inference generate --checkpoint gs://…/reference`
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    hf_dir = gcs_emulator.download(BUCKET, "reference-hf", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():  # greedy, by hand: no generation config can stop it early
        for _ in range(8):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got == ids[0, len(PROMPT) :].tolist()


def test_a_gs_run_dir_without_gcsfs_is_refused_at_load(monkeypatch):
    from agentrefine_jax.config import ConfigError, load_config
    from agentrefine_jax.config_checks import check_outputs

    cfg = load_config("tiny", [f"train.run_dir=gs://{BUCKET}/run"])
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if the `gcs` extra were not installed
    with pytest.raises(
        ConfigError, match=r'run_dir=gs://\S+: gs:// URLs need gcsfs: pip install -e "\.\[gcs\]"'
    ):
        check_outputs(cfg)


OPEN_RUN_CHECKPOINTS = """
import json, sys
from agentrefine_jax.checkpoint.train_state import TrainCheckpoints
from agentrefine_jax.paths import as_path

root = as_path(sys.argv[1])  # points gcsfs and TensorStore at the emulator, before either loads
ckpts = TrainCheckpoints(root, keep=2)
import gcsfs

left = gcsfs.GCSFileSystem().find(sys.argv[1])  # what is stored the moment it returns
print(json.dumps({"steps": list(ckpts.mngr.all_steps()), "left": left}))
ckpts.mngr.close()
"""


def test_an_uncommitted_step_is_removed_before_the_checkpoints_are_listed(gcs_emulator, tmp_path):
    """A run whose only step was cut off mid-save (no commit marker): opening its checkpoints
    removes that step first, then lists an empty root. Orbax's own cleanup ran in a thread
    beside that listing, which raised FileNotFoundError when the step's last object went
    between "the root exists" and "list the root" (CI, under load)."""
    bucket = "uncommitted-only"
    gcs_emulator.create_bucket(bucket)
    for name in ("params/_METADATA", "params/array_metadatas/process_0", "meta/metadata"):
        gcs_emulator.write(bucket, f"run/checkpoints/2/{name}", b"{}")
    gcs_emulator.write(bucket, "run/metrics.jsonl", b'{"step": 1, "loss": 1.0}\n')
    root = f"gs://{bucket}/run/checkpoints"
    proc = subprocess.run(
        [sys.executable, "-c", OPEN_RUN_CHECKPOINTS, root],
        cwd=REPO,
        env=gcs_emulator.env(_env(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"steps": [], "left": []}
    assert list(gcs_emulator.objects(bucket)) == ["run/metrics.jsonl"]  # nothing else touched
