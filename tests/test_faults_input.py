"""Hostile input files (issue 23, item 6): each is refused or skipped in one clear line, never a traceback.

Every case is a real crafted file in tmp_path given to a real CLI: `main(argv)` in-process (an exception
escaping `main` fails the test as it would print a traceback), a subprocess where the process itself is the
point (exit status, stderr, time before any data work). "Nothing read from outside the directory" is
proved by placing a valid copy of the model's weights outside it: had the reader followed the path, the
import would have succeeded.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest
from hf_fixtures import make_checkpoint
from safetensors.numpy import load_file, save_file
from test_cli_errors import _assert_one_line_error as assert_one_line
from test_cli_errors import run_main

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------ HF directories


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "good", "llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory, hf_dir) -> pathlib.Path:
    """A VALID copy of the weights outside any model directory under test."""
    path = tmp_path_factory.mktemp("elsewhere") / WEIGHTS
    shutil.copy(hf_dir / WEIGHTS, path)
    return path


def _names(hf_dir: pathlib.Path) -> list[str]:
    return sorted(load_file(hf_dir / WEIGHTS))


def _index_to(relative: bool):
    def mutate(d: pathlib.Path, outside: pathlib.Path) -> None:
        target = os.path.relpath(outside, d) if relative else str(outside)  # ../../elsewhere0/... or /tmp/...
        names = _names(d)
        (d / WEIGHTS).unlink()
        (d / INDEX).write_text(json.dumps({"weight_map": {n: target for n in names}}))

    return mutate


def _symlink_to(target: str | None):
    def mutate(d: pathlib.Path, outside: pathlib.Path) -> None:
        (d / WEIGHTS).unlink()
        (d / WEIGHTS).symlink_to(target or outside)

    return mutate


def _rewrite_bytes(fn):
    def mutate(d: pathlib.Path, outside: pathlib.Path) -> None:
        p = d / WEIGHTS
        p.write_bytes(fn(p.read_bytes()))

    return mutate


def _garbage_header(b: bytes) -> bytes:
    n = struct.unpack("<Q", b[:8])[0]
    return b[:8] + b"\xff" * n + b[8 + n :]


def _edit_tensor(name: str, fn):
    def mutate(d: pathlib.Path, outside: pathlib.Path) -> None:
        tensors = load_file(d / WEIGHTS)
        tensors[name] = fn(tensors[name])
        save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})

    return mutate


def _with_nan(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flat[a.size // 2] = np.nan
    return a


def _with_inf(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flat[-1] = np.inf
    return a


def _pickle_only(d: pathlib.Path, outside: pathlib.Path) -> None:
    (d / WEIGHTS).unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")


def _gpt2_config(d: pathlib.Path, outside: pathlib.Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))


def _wrong_shape(d: pathlib.Path, outside: pathlib.Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8  # the tensors stay as they were
    (d / "config.json").write_text(json.dumps(cfg))


def _fifo(d: pathlib.Path, outside: pathlib.Path) -> None:
    (d / WEIGHTS).unlink()
    os.mkfifo(d / WEIGHTS)  # a reader that opens it blocks forever


def _config_is(target: str):
    def mutate(d: pathlib.Path, outside: pathlib.Path) -> None:
        (d / "config.json").unlink()
        if target == "fifo":
            os.mkfifo(d / "config.json")
        elif target == "deep":
            (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
        else:
            (d / "config.json").symlink_to(target)

    return mutate


EMBED = "model.embed_tokens.weight"
HOSTILE = {
    "index-parent-traversal": (_index_to(relative=True), "'../../"),
    "index-absolute-path": (_index_to(relative=False), "outside"),
    "symlink-out-of-dir": (_symlink_to(None), "outside"),
    "symlink-to-dev-zero": (_symlink_to("/dev/zero"), "resolves to /dev/zero"),
    "fifo": (_fifo, "not a regular file"),
    "truncated": (_rewrite_bytes(lambda b: b[: len(b) // 2]), "not a valid safetensors file"),
    "garbage-header": (_rewrite_bytes(_garbage_header), "not a valid safetensors file"),
    "2**62-header-length": (
        _rewrite_bytes(lambda b: struct.pack("<Q", 2**62) + b[8:]),
        "header claims 4611686018427387904 bytes",
    ),
    "3-byte-file": (_rewrite_bytes(lambda b: b[:3]), "truncated safetensors file (3 bytes"),
    "int32-tensor": (_edit_tensor(EMBED, lambda a: a.astype(np.int32)), f"tensor {EMBED} is I32"),
    "nan-weight": (_edit_tensor(EMBED, _with_nan), f"tensor {EMBED} holds NaN or Inf"),
    "inf-weight": (_edit_tensor("model.norm.weight", _with_inf), "tensor model.norm.weight holds NaN or Inf"),
    "config-dev-zero": (_config_is("/dev/zero"), "config.json is not a regular JSON file"),
    "config-fifo": (_config_is("fifo"), "config.json is not a regular JSON file"),
    "config-deep-json": (_config_is("deep"), "config.json is JSON nested deeper than the parser allows"),
    "pickle-only": (_pickle_only, "pickle-based weights ['pytorch_model.bin']"),
    "gpt2-config": (_gpt2_config, "model_type 'gpt2' is not supported"),
    "wrong-shapes": (_wrong_shape, "config.json implies"),
}


def hostile_dir(
    hf_dir: pathlib.Path, elsewhere: pathlib.Path, tmp_path: pathlib.Path, case: str
) -> pathlib.Path:
    d = tmp_path / "models" / case
    shutil.copytree(hf_dir, d)
    HOSTILE[case][0](d, elsewhere)
    return d


@pytest.mark.timeout(120, method="thread")  # a FIFO opened by the reader blocks it in native code
@pytest.mark.parametrize("case", list(HOSTILE))
def test_from_hf_refuses_a_hostile_directory_in_one_line(case, hf_dir, elsewhere, tmp_path, capsys):
    d = hostile_dir(hf_dir, elsewhere, tmp_path, case)
    out = tmp_path / "ckpt"
    res = run_main("export", ["from-hf", "--hf", str(d), "--out", str(out), "-q"], capsys)
    assert_one_line(res, "export", HOSTILE[case][1])
    assert not out.exists() or not any(out.iterdir())  # nothing imported


def test_weights_inside_the_directory_still_load(hf_dir, tmp_path, capsys):
    """Controls: the same weights through an index into a subfolder, and a Hugging Face hub cache snapshot
    (files are symlinks to ../../blobs/<sha>) import fine."""
    sub = tmp_path / "sharded"
    shutil.copytree(hf_dir, sub)
    (sub / "shards").mkdir()
    (sub / WEIGHTS).rename(sub / "shards" / WEIGHTS)
    (sub / INDEX).write_text(json.dumps({"weight_map": {n: f"shards/{WEIGHTS}" for n in _names(hf_dir)}}))
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in hf_dir.iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        (snap / f.name).symlink_to(f"../../blobs/sha-{f.name}")
    for i, d in enumerate((sub, snap)):
        res = run_main("export", ["from-hf", "--hf", str(d), "--out", str(tmp_path / f"c{i}"), "-q"], capsys)
        assert res.returncode == 0, res.stderr
        assert (tmp_path / f"c{i}" / "0").is_dir()


TRAIN_CASES = (
    "index-parent-traversal",
    "symlink-out-of-dir",
    "truncated",
    "pickle-only",
    "gpt2-config",
    "wrong-shapes",
)


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_init_from_hf_gives_the_same_one_line(case, hf_dir, elsewhere, tmp_path, capsys):
    d = hostile_dir(hf_dir, elsewhere, tmp_path, case)
    run = tmp_path / "run"
    argv = ["--config", "tiny", "--set", f"train.run_dir={run}", "--set", f"train.init_from_hf={d}", "-q"]
    argv += ["--set", f"data.train_files={tmp_path / 'absent.jsonl'}"]  # the check comes before any data
    argv += ["--set", "mesh.fsdp=2", "--set", "mesh.tensor=4"]  # the demo's batch of 4 on 8 test devices
    res = run_main("train", argv, capsys)
    line = assert_one_line(res, "train", f"train.init_from_hf={d}", HOSTILE[case][1])
    assert "does not match model config" not in line  # the directory itself is named as the fault
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


def test_train_process_refuses_weights_outside_the_directory_before_any_data_work(
    hf_dir, elsewhere, tmp_path
):
    d = hostile_dir(hf_dir, elsewhere, tmp_path, "index-parent-traversal")
    run = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny", "-q"]
    cmd += ["--set", f"train.run_dir={run}", "--set", f"train.init_from_hf={d}"]
    cmd += ["--set", f"data.train_files={tmp_path / 'absent.jsonl'}"]  # reached only if the check came late
    cmd += ["--set", "mesh.fsdp=2", "--set", "mesh.tensor=4"]  # the 8 CPU devices of conftest's XLA_FLAGS
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert_one_line(res, "train", "resolves to", "outside")
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


def test_train_names_a_nan_weight_found_while_loading_the_base(tmp_path, capsys):
    """NaN is only seen when the weights are read (after the data pipeline): still one line and exit 2.
    The directory holds the demo config's own architecture, so every header check passes first."""
    from test_generate_chat import numpy_model

    from agentrefine_jax.hf.io import save_hf
    from agentrefine_jax.models import preset

    cfg = preset("tiny")
    d = tmp_path / "tiny"
    save_hf(numpy_model(cfg, seed=0, std=0.02), cfg, d, dtype="float32")
    _edit_tensor("model.norm.weight", _with_nan)(d, d)
    run = tmp_path / "run"
    argv = ["--config", "tiny", "-q", "--set", f"train.run_dir={run}", "--set", f"train.init_from_hf={d}"]
    argv += ["--set", "mesh.fsdp=2", "--set", "mesh.tensor=4", "--set", "train.export_hf_at_end=none"]
    argv += ["--set", "data.tokenizer=llama3"]  # the directory has no tokenizer files: named, never implied
    rows = tmp_path / "rows.jsonl"  # four unpacked rows: one global batch, little tokenizing
    rows.write_text((json.dumps(GOOD) + "\n") * 4)
    argv += ["--set", f"data.train_files={rows}", "--set", "data.pack=false"]
    res = run_main("train", argv, capsys)
    assert_one_line(res, "train", f"train.init_from_hf={d}", "tensor model.norm.weight holds NaN or Inf")
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


def test_train_mesh_the_devices_cannot_fill_is_one_line(tmp_path, capsys):
    argv = ["--config", "tiny", "-q", "--set", f"train.run_dir={tmp_path / 'run'}", "--set", "mesh.fsdp=3"]
    res = run_main("train", argv, capsys)
    assert_one_line(res, "train", "mesh.data/fsdp/tensor: mesh {'data': 1, 'fsdp': 3, 'tensor': 1} needs 3")


# ------------------------------------------------------------------------------------ lone surrogates

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SURROGATE_LINE = (
    '{"messages": [{"role": "user", "content": "x \\ud800 y"}, {"role": "assistant", "content": "ok"}]}'
)


def test_data_stats_skips_and_counts_a_lone_surrogate_row_naming_it(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), SURROGATE_LINE, json.dumps(GOOD)]) + "\n")
    res = run_main("data", ["stats", "--input", str(path), "--json", "-q"], capsys)
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert (stats["parsed"], stats["examples"], stats["skipped"]) == (2, 2, {"invalid unicode": 1})
    res = run_main("data", ["stats", "--input", str(path), "-q"], capsys)
    assert res.returncode == 0 and "Traceback" not in res.stderr
    assert f"invalid unicode: 1 (e.g. {path}:2) messages[0].content: lone surrogate U+D800" in res.stdout
    dump = tmp_path / "dump.jsonl"  # dump (and training: the same build_data) skip it too
    res = run_main("data", ["dump", "--input", str(path), "--out", str(dump), "--no-pack", "-q"], capsys)
    assert res.returncode == 0 and len(dump.read_text().splitlines()) == 2


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> pathlib.Path:
    from test_generate_chat import CFG, numpy_model

    from agentrefine_jax.checkpoint import save_model

    path = tmp_path_factory.mktemp("chat") / "model"
    save_model(path, numpy_model(CFG, seed=0, std=0.1), CFG, step=0, tokenizer="llama3", template="llama3")
    return path


def test_generate_refuses_a_lone_surrogate_in_one_line(chat_checkpoint, tmp_path, capsys):
    msgs = tmp_path / "messages.json"
    msgs.write_text('[{"role": "user", "content": "bad \\udfff text"}]')
    base = ["generate", "--checkpoint", str(chat_checkpoint), "--max-new-tokens", "2", "-q"]
    res = run_main("inference", [*base, "--messages", str(msgs)], capsys)
    assert_one_line(res, "inference", "messages[0].content: lone surrogate U+DFFF")
    assert res.stdout == ""
    # An undecodable command-line byte arrives as a surrogate escape (PEP 383): the same refusal.
    res = run_main("inference", [*base, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")], capsys)
    assert_one_line(res, "inference", "lone surrogate U+DCE9")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    res = run_main("inference", [*base, "--messages", str(deep)], capsys)
    assert_one_line(res, "inference", "nested deeper than the parser allows")


@pytest.mark.timeout(300)
def test_server_answers_400_to_a_lone_surrogate_and_to_deep_json(chat_checkpoint):
    from agentrefine_jax.inference.chat import ChatGenerator
    from agentrefine_jax.inference.server import ChatService, make_server

    service = ChatService(ChatGenerator.from_checkpoint(str(chat_checkpoint)), log=lambda _: None)
    srv = make_server(service, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:

        def post(body: bytes) -> tuple[int, dict]:
            req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST")
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        surrogate = '{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud800"}]}'
        status, body = post((surrogate % service.model_name).encode())
        assert status == 400, body
        assert "messages[0].content: lone surrogate U+D800" in body["error"]["message"]
        status, body = post(b'{"\\udc80": 1}')  # in a key: the error message must still encode
        assert status == 400 and "a key holds a lone surrogate U+DC80" in body["error"]["message"], body
        status, body = post(b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "nested deeper" in body["error"]["message"], body
        status, body = post(b"\xff\xfe{not utf-8")
        assert status == 400, body
        with urllib.request.urlopen(f"{url}/health", timeout=60) as resp:  # still serving
            assert resp.status == 200
    finally:
        srv.shutdown()
        srv.server_close()


# ------------------------------------------------------------------------------------ synth: deep JSON


def _raw(rid: str, thought: str = "look") -> dict:
    return {
        "id": rid,
        "persona": "p",
        "script": {"environment": "e", "task": "t", "available_actions": ["go {place}"]},
        "turns": [
            {"role": "player", "thought": thought, "action": "fly"},
            {"role": "dm", "observation": "no", "error": True, "task_success": False},
            {"role": "player", "thought": "again", "action": "go home"},
            {"role": "dm", "observation": "home", "error": False, "task_success": True},
        ],
    }


def test_synth_verify_and_convert_skip_deep_json_and_surrogates_with_reasons(tmp_path, capsys):
    raw = tmp_path / "raw.jsonl"
    lines = [json.dumps(_raw("ok")), "[" * 100_000 + "]" * 100_000, json.dumps(_raw("bad", "\ud800"))]
    raw.write_text("\n".join(lines) + "\n")
    report = tmp_path / "verify.jsonl"
    res = run_main("synth", ["verify", "--input", str(raw), "--out", str(report)], capsys)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rows] == [
        (1, "ok"),
        (2, "json_too_deep"),
        (3, "invalid_unicode"),
    ]
    assert "turns[0].thought: lone surrogate U+D800" in rows[2]["detail"]
    out, summary = tmp_path / "train.jsonl", tmp_path / "summary.json"
    res = run_main(
        "synth", ["convert", "--input", str(raw), "--out", str(out), "--summary", str(summary)], capsys
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert json.loads(summary.read_text())["dropped"] == {"invalid_unicode": 1, "json_too_deep": 1}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["ok"]


# ------------------------------------------------------------------------------------ AgentBoard PDDL

UNBALANCED_DOMAIN = "(define (domain gripper-strips)\n  (:predicates (room ?r) (ball ?b)"
BAD_PROBLEMS = {
    "unbalanced-domain": ("gripper.pddl", UNBALANCED_DOMAIN),
    "garbage-domain": ("gripper.pddl", "this is not PDDL"),
    "garbage-problem": ("gripper/p2.pddl", "garbage ) ) ("),
    "undefined-predicate": (
        "gripper/p10.pddl",
        "(define (problem p10) (:domain gripper-strips) (:objects a)"
        " (:init (nosuch a)) (:goal (and (nosuch a))))",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PROBLEMS))
def test_malformed_agentboard_pddl_is_one_line_naming_the_file(case, tmp_path, capsys):
    from agentboard_fixture import PDDL_DIR, make_checkout

    root = make_checkout(tmp_path / "ab")
    rel, text = BAD_PROBLEMS[case]
    (root / PDDL_DIR / rel).write_text(text)
    argv = [
        "--protocol",
        "agentboard",
        "--agentboard-dir",
        str(root),
        "--tasks",
        "pddl",
        "--policy",
        "random",
    ]
    res = run_main("eval", [*argv, "-q"], capsys)
    assert_one_line(res, "eval", f"{root / PDDL_DIR / rel}: malformed PDDL")
