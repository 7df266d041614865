"""`python -m agentrefine_jax.export` end to end: HF -> project -> HF, checked by transformers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import hf_fixtures as F
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from agentrefine_jax import checkpoint as ckpt
from agentrefine_jax.export.cli import main
from agentrefine_jax.hf.io import load_hf_model

VERIFY_LENS = "16,40"  # both past the tiny Mistral's sliding window (8)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("cli")
    return {
        "llama": F.make_checkpoint(root / "llama", "llama", config_layout="tf4"),
        "mistral": F.make_checkpoint(root / "mistral", "mistral", config_layout="tf5"),
    }


@pytest.fixture(scope="module")
def llama_ckpt(hf_dirs: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("cli_ck") / "llama"
    assert main(["from-hf", "--hf", str(hf_dirs["llama"]), "--out", str(out), "--template", "llama3"]) == 0
    return out


def test_llama_round_trip_sharded_float32(hf_dirs, llama_ckpt, tmp_path, capsys) -> None:
    src = hf_dirs["llama"]
    capsys.readouterr()
    out = tmp_path / "hf"
    rc = main(
        [
            "to-hf",
            "--checkpoint",
            str(llama_ckpt),
            "--out",
            str(out),
            "--export-dtype",
            "float32",
            "--max-shard-size",
            "200KB",
        ]
    )
    assert rc == 0
    log = capsys.readouterr().err  # progress goes to stderr
    assert "wrote model-00001-of-" in log

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]

    ids = F.random_ids(np.random.default_rng(0), 512, 2, 48)
    original = F.hf_logits(src, ids)
    exported = F.hf_logits(out, ids)  # load_hf fails on any missing/unexpected weight
    np.testing.assert_array_equal(exported, original)

    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(llama_ckpt), "--hf", str(out), "--seq-lens", VERIFY_LENS]) == 0
    assert "PASS" in capsys.readouterr().out

    # The sharded export (with index) reads back into exactly the checkpoint's parameters.
    _, reread = load_hf_model(out)
    _, model, _ = ckpt.load_model(llama_ckpt)
    for a, b in zip(jax.tree.leaves(nnx.state(reread)), jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Existing outputs are refused before any work is done.
    assert main(["to-hf", "--checkpoint", str(llama_ckpt), "--out", str(out)]) == 2
    assert main(["from-hf", "--hf", str(src), "--out", str(llama_ckpt)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_mistral_round_trip_bfloat16_with_tokenizer(hf_dirs, tmp_path, capsys) -> None:
    tokenizers = pytest.importorskip("agentrefine_jax.data.tokenizers")
    src = hf_dirs["mistral"]
    ck = tmp_path / "ck"
    args = ["from-hf", "--hf", str(src), "--out", str(ck), "--tokenizer", "mistral", "--template", "mistral"]
    assert main(args) == 0
    progress = capsys.readouterr().err
    assert "[30/30] model.norm.weight -> final_norm" in progress
    _, _, meta = ckpt.load_model(ck)
    assert meta.tokenizer == "mistral" and meta.template == "mistral"

    out = tmp_path / "hf"
    assert main(["to-hf", "--checkpoint", str(ck), "--out", str(out), "--export-dtype", "bfloat16"]) == 0
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 8

    # Tokenizer files written, and the exported tokenizer encodes like the project's.
    from transformers import AutoTokenizer

    text = "[INST] list the files [/INST] ls -la</s>"
    exported_tok = AutoTokenizer.from_pretrained(out)
    assert exported_tok(text)["input_ids"] == tokenizers.load_tokenizer("mistral")(text)["input_ids"]

    # bfloat16 export == the original with its weights rounded to bfloat16.
    original = F.load_hf(src)
    with torch.no_grad():
        for p in original.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    ids = F.random_ids(np.random.default_rng(1), 512, 1, 40)
    assert float(np.abs(F.hf_logits(out, ids) - F.hf_logits(original, ids)).max()) <= 1e-4

    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(ck), "--hf", str(out), "--seq-lens", VERIFY_LENS]) == 0
    assert "rounding checkpoint weights to bfloat16" in capsys.readouterr().err


def test_default_flags_round_trip_is_exact(hf_dirs, llama_ckpt, tmp_path, capsys) -> None:
    """float32 HF -> project -> HF with no --export-dtype: `auto` writes the imported dtype, bit for bit."""
    from safetensors.numpy import load_file

    src = hf_dirs["llama"]
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["to-hf", "--checkpoint", str(llama_ckpt), "--out", str(out)]) == 0
    assert "--export-dtype auto: float32, the dtype it was imported from" in capsys.readouterr().err

    def tensors(d: pathlib.Path) -> dict[str, np.ndarray]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    before, after = tensors(src), tensors(out)
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype == np.float32, name
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    ids = F.random_ids(np.random.default_rng(2), 512, 1, 40)
    np.testing.assert_array_equal(F.hf_logits(out, ids), F.hf_logits(src, ids))


def test_verify_rejects_a_corrupted_layer(hf_dirs, llama_ckpt, tmp_path, capsys) -> None:
    src = hf_dirs["llama"]
    cfg, model, _ = ckpt.load_model(llama_ckpt)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    w = params["layers"]["w_down"]
    noise = 0.02 * float(jnp.std(w[1])) * jax.random.normal(jax.random.key(0), w.shape[1:], w.dtype)
    params["layers"]["w_down"] = w.at[1].add(noise)
    bad = tmp_path / "bad"
    ckpt.save_model(bad, params, cfg)

    capsys.readouterr()
    rc = main(["verify", "--checkpoint", str(bad), "--hf", str(src), "--seq-lens", VERIFY_LENS, "--json"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["max_abs_diff"] > result["atol"]

    # Architecturally different HF model: refused before any comparison.
    rc = main(["verify", "--checkpoint", str(llama_ckpt), "--hf", str(hf_dirs["mistral"])])
    captured = capsys.readouterr()
    assert rc == 1 and "family: checkpoint 'llama' vs HF 'mistral'" in captured.out + captured.err


def test_cli_process_refuses_pickle_weights(tmp_path) -> None:
    d = tmp_path / "pickled"
    F.llama_config().save_pretrained(d)
    torch.save({"model.norm.weight": torch.ones(64)}, d / "pytorch_model.bin")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrefine_jax.export",
            "from-hf",
            "--hf",
            str(d),
            "--out",
            str(tmp_path / "ck"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pickle-based weights ['pytorch_model.bin']" in proc.stderr
    assert not (tmp_path / "ck").exists()
