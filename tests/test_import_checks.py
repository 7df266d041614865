"""Every import checks the whole tensor set, every shape and the tokenizer against the model before
it writes or trains anything (issue 44), and `--print-config` resolves the model exactly as the run
does. Before: `export from-gguf` on a GGUF missing a tensor or holding a misshapen one said `done`;
HF weights of 2 layers under a config.json of 1 trained a 1-layer model (layer 1 written over layer
0); a directory without tokenizer files trained with llama3's ids against a 49,152 vocabulary (NaN
at step 1); `--print-config` printed the preset for a directory that does not exist; a config.json
that is a JSON list, or a file given as the directory, was a traceback.

Real files: GGUF files written with the `gguf` package's writer (tests/test_gguf_import.py), small
transformers checkpoints (tests/hf_fixtures.py), the real SmolLM2 fixture (tests/real_model.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from faults_disk import env
from hf_fixtures import chatml_llama_dir, demo_conversations, make_checkpoint
from safetensors.numpy import load_file, save_file
from test_cli_errors import _assert_one_line_error as one_line
from test_cli_errors import run_main
from test_gguf_import import _hf_weights, write_gguf

from agentrefine_jax.hf.io import check_hf_dir, load_hf_model


def _cli(tool: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"agentrefine_jax.{tool}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=cwd)


# ------------------------------------------------------------------------------------- GGUF


def _from_gguf(path: pathlib.Path, out: pathlib.Path, capsys) -> str:
    res = run_main("export", ["from-gguf", "--gguf", str(path), "--out", str(out), "-q"], capsys)
    line = one_line(res, "export")
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.partial-*"))  # nothing written
    return line


def test_from_gguf_refuses_a_missing_an_extra_or_a_misshapen_tensor(tmp_path, capsys):
    weights = _hf_weights()
    missing = dict(weights)
    del missing["model.layers.1.mlp.up_proj.weight"]
    line = _from_gguf(write_gguf(tmp_path / "missing.gguf", missing), tmp_path / "a", capsys)
    assert "lacks 1 tensors: ['model.layers.1.mlp.up_proj.weight']" in line

    short = dict(weights)
    short["model.layers.0.mlp.gate_proj.weight"] = weights["model.layers.0.mlp.gate_proj.weight"][:-1]
    line = _from_gguf(write_gguf(tmp_path / "short.gguf", short), tmp_path / "b", capsys)
    assert (
        "model.layers.0.mlp.gate_proj.weight has shape (127, 64), the file's metadata implies (128, 64)"
        in line
    )

    # A third block of tensors under block_count 2: refused, not dropped.
    extra = dict(weights)
    extra |= {k.replace("layers.1.", "layers.2."): v for k, v in weights.items() if ".layers.1." in k}
    line = _from_gguf(write_gguf(tmp_path / "extra.gguf", extra), tmp_path / "c", capsys)
    assert "unexpected tensor in HF checkpoint: model.layers.2." in line
    assert "the file's metadata says 2 layers" in line and "8 more unexpected" in line


# --------------------------------------------------------------------------------------- HF


@pytest.fixture(scope="module")
def two_layers_said_one(tmp_path_factory) -> pathlib.Path:
    """A 2-layer checkpoint whose config.json says 1 layer."""
    d = make_checkpoint(tmp_path_factory.mktemp("hf") / "two", "llama", num_hidden_layers=2)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return d


def test_weights_with_more_layers_than_the_config_are_refused_everywhere(
    two_layers_said_one, tmp_path, capsys
):
    d = two_layers_said_one
    for check in (check_hf_dir, load_hf_model):
        with pytest.raises(ValueError, match=r"unexpected tensor in HF checkpoint: model\.layers\.1\.") as e:
            check(d)
        assert "config.json says 1 layers" in str(e.value) and "\n" not in str(e.value)
    out = tmp_path / "ck"
    res = run_main("export", ["from-hf", "--hf", str(d), "--out", str(out), "-q"], capsys)
    one_line(res, "export", "model.layers.1.", "config.json says 1 layers")
    assert not out.exists()
    # The trainer (and its --print-config) refuse it before any data work, naming the tensors.
    run = tmp_path / "run"
    argv = ["--config", "tiny", "-q", "--set", f"train.init_from_hf={d}", "--set", f"train.run_dir={run}"]
    argv += ["--set", f"data.train_files={tmp_path / 'absent.jsonl'}"]
    for extra in ([], ["--print-config"]):
        res = run_main("train", [*argv, *extra], capsys)
        one_line(res, "train", f"train.init_from_hf={d}", "model.layers.1.", "config.json says 1 layers")
    assert not run.exists() or not list(run.glob("checkpoints/*"))


def test_missing_extra_and_misshapen_tensors_are_named_in_one_line(two_layers_said_one, tmp_path):
    d = tmp_path / "mixed"
    shutil.copytree(two_layers_said_one, d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        check_hf_dir(d)
    msg = str(e.value)
    assert "\n" not in msg
    assert "lacks 1 tensors: ['model.norm.weight']" in msg
    assert "unexpected tensor in HF checkpoint: model.layers.1." in msg
    assert "model.layers.0.mlp.up_proj.weight has shape (159, 64), config.json implies (160, 64)" in msg


def _weights_only(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """`src`'s config and weights without any tokenizer file."""
    dst.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (src / name).exists():  # a hard link: a symlink out of the directory is refused
            os.link((src / name).resolve(), dst / name)
    return dst


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> pathlib.Path:
    texts = [m["content"] for c in demo_conversations(8) for m in c]
    return chatml_llama_dir(tmp_path_factory.mktemp("chatml") / "hf", texts)


def test_a_directory_without_tokenizer_files_is_refused_unless_one_is_named(chatml_dir, tmp_path, capsys):
    bare = _weights_only(chatml_dir, tmp_path / "bare")
    base = ["--config", "tiny", "-q", "--set", f"train.init_from_hf={bare}", "--print-config"]
    res = run_main("train", base, capsys)
    one_line(res, "train", f"train.init_from_hf={bare} has no tokenizer files", "--set data.tokenizer=")
    # Named explicitly (here: the same tokenizer from another directory): taken.
    res = run_main("train", [*base, "--set", f"data.tokenizer={chatml_dir}"], capsys)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["data"]["tokenizer"] == str(chatml_dir)
    # Named, but llama3's ids reach 128255 against this model's vocabulary: refused, naming both.
    vocab = json.loads((chatml_dir / "config.json").read_text())["vocab_size"]
    res = run_main("train", [*base, "--set", "data.tokenizer=llama3"], capsys)
    one_line(
        res, "train", f"does not fit model.vocab_size={vocab}", "largest id is 128255", "'<|eot_id|>' 128009"
    )


def test_the_real_model_without_its_tokenizer_never_trains_on_llama3_ids(smollm2_dir, tmp_path):
    """The issue's case: SmolLM2 (49,152 tokens) without tokenizer files. The run itself (not only
    --print-config) stops before any data work, in one line, instead of a NaN at step 1."""
    bare = _weights_only(pathlib.Path(smollm2_dir), tmp_path / "smol")
    argv = [
        "--config",
        "demo",
        "-q",
        "--set",
        f"train.init_from_hf={bare}",
        "--set",
        "train.init_from_gguf=null",
    ]
    argv += ["--set", f"train.run_dir={tmp_path / 'run'}"]
    one_line(_cli("train", *argv), "train", "has no tokenizer files")
    res = _cli("train", *argv, "--set", "data.tokenizer=llama3")
    one_line(res, "train", "data.tokenizer=llama3 does not fit model.vocab_size=49152", "128255")
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(capsys):
    res = run_main("train", ["--config", "tiny", "--set", "model.vocab_size=1000", "--print-config"], capsys)
    one_line(res, "train", "data.tokenizer=llama3 does not fit model.vocab_size=1000", "largest id is 128255")


# --------------------------------------------------------------- --print-config = the run's errors


def _bad_dirs(tmp_path: pathlib.Path, good: pathlib.Path) -> dict[str, tuple[pathlib.Path, str]]:
    def with_config(name: str, text: str) -> pathlib.Path:
        d = tmp_path / name
        shutil.copytree(good, d)
        (d / "config.json").unlink()
        (d / "config.json").write_text(text)
        return d

    gpt2 = {**json.loads((good / "config.json").read_text()), "model_type": "gpt2"}
    (tmp_path / "a-file").write_text("not a directory\n")
    return {
        "absent": (tmp_path / "absent", "not found"),
        "not-json": (with_config("not-json", "{not json"), "is not valid JSON"),
        "json-list": (with_config("json-list", "[1, 2]"), "holds a JSON list, not an object"),
        "gpt2": (with_config("gpt2", json.dumps(gpt2)), "model_type 'gpt2' is not supported"),
        "a-file": (tmp_path / "a-file", "is a file, not a Hugging Face model directory"),
    }


@pytest.mark.parametrize("source", ["auto", "config"])
def test_print_config_fails_as_the_run_does(source, chatml_dir, tmp_path, capsys):
    for case, (d, needle) in _bad_dirs(tmp_path, chatml_dir).items():
        argv = [
            "--config",
            "tiny",
            "-q",
            "--set",
            f"train.init_from_hf={d}",
            "--set",
            f"train.model_source={source}",
        ]
        argv += ["--set", f"train.run_dir={tmp_path / 'run'}"]
        for extra in (["--print-config"], []):
            res = run_main("train", [*argv, *extra], capsys)
            assert "Traceback" not in res.stderr, (case, res.stderr)
            one_line(res, "train", f"train.init_from_hf={d}", needle)
        assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("checkpoints/*"))


def test_a_list_config_json_or_a_file_is_one_line_for_every_reader(chatml_dir, tmp_path, capsys):
    cases = _bad_dirs(tmp_path, chatml_dir)
    for case in ("json-list", "a-file"):
        d, needle = cases[case]
        res = run_main(
            "export", ["from-hf", "--hf", str(d), "--out", str(tmp_path / f"out-{case}"), "-q"], capsys
        )
        one_line(res, "export", needle)
        res = run_main(
            "inference",
            ["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "1", "-q"],
            capsys,
        )
        one_line(
            res, "inference", *([needle] if case == "json-list" else [])
        )  # a file: not a checkpoint either
