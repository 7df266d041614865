"""`train.init_from_hf=DIR` and nothing else about the model (`train.model_source`, docs/export.md):
the architecture, special tokens, context, tokenizer and chat template all come from DIR; a `--set`
that contradicts DIR is refused naming the field; the run's paths are absolute, so it loads from
another working directory; its export carries DIR's special tokens and context."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from hf_fixtures import chatml_llama_dir

from agentrefine_jax.config import load_config as _load
from agentrefine_jax.config_checks import ConfigError
from agentrefine_jax.hf import model_source

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO = REPO / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
CONVERSATIONS = [json.loads(line)["messages"] for line in DEMO.read_text().splitlines()[:8]]


def load_config(name: str, overrides: list[str]):
    """As the train CLI loads a config: load, then resolve train.model_source."""
    return model_source.resolve(_load(name, overrides))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    texts = [m["content"] for c in CONVERSATIONS for m in c]
    return chatml_llama_dir(tmp_path_factory.mktemp("smol") / "hf", texts)


def test_the_model_tokenizer_and_template_come_from_the_directory(hf_dir) -> None:
    from agentrefine_jax.hf.io import read_hf_config
    from agentrefine_jax.models.config import HF_FIELDS

    cfg = load_config("tiny", [f"train.init_from_hf={hf_dir}"])
    want = read_hf_config(hf_dir)
    assert {f: getattr(cfg.model, f) for f in HF_FIELDS} == {f: getattr(want, f) for f in HF_FIELDS}
    assert (cfg.model.bos_token_id, cfg.model.eos_token_ids, cfg.model.pad_token_id) == (1, (2,), 0)
    assert cfg.model.max_position_embeddings == 8192
    assert (cfg.model.dtype, cfg.model.param_dtype) == ("float32", "float32")  # the config's execution
    assert (cfg.data.tokenizer, cfg.data.template) == (str(hf_dir), "hf")
    # Agreeing --set keys (floats at float32: 1e-05 vs its float32 round trip) are fine...
    eps = "model.rms_norm_eps=9.999999747378752e-06"
    same = load_config("tiny", [f"train.init_from_hf={hf_dir}", eps, "model.num_heads=4"])
    assert same.model == cfg.model
    # ... a contradicting one is refused, naming the field.
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"train.init_from_hf={hf_dir}", "model.num_heads=8", "model.num_kv_heads=4"])
    assert "--set model.num_heads=8 contradicts train.init_from_hf=" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_config_model_must_match_the_directory_tokens_and_context(hf_dir, tmp_path) -> None:
    """model_source=config: the preset's llama3 token ids and 2048 context are refused in one line."""
    argv = ["--config", "tiny", "-q", "--set", f"train.run_dir={tmp_path / 'run'}"]
    argv += ["--set", f"train.init_from_hf={hf_dir}", "--set", "train.model_source=config"]
    argv += ["--set", "mesh.fsdp=2", "--set", "mesh.tensor=4", "--set", "train.global_batch_size=2"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "head_dim", "rope_theta"):
        from agentrefine_jax.hf.io import read_hf_config

        argv += ["--set", f"model.{key}={getattr(read_hf_config(hf_dir), key)}"]
    r = subprocess.run([sys.executable, "-m", "agentrefine_jax.train", *argv], capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "does not match model config" in line
    for field in ("max_position_embeddings", "bos_token_id", "eos_token_ids", "pad_token_id"):
        assert f"{field}: config" in line


def test_trains_from_a_relative_dir_exports_its_tokens_and_loads_from_elsewhere(hf_dir, tmp_path) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    os.symlink(hf_dir, work / "hf")  # the run names it relatively: `train.init_from_hf=hf`
    sets = ["train.init_from_hf=hf", "train.run_dir=run", "train.max_steps=2", "train.eval_every=0",
            "train.checkpoint_every=2", "data.max_length=256", "train.global_batch_size=2",
            "train.export_hf_at_end=exported", "mesh.fsdp=2", "mesh.tensor=4"]  # fmt: skip
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny", "-q"]
    r = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], cwd=work, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ours = json.loads((work / "run" / "exported" / "config.json").read_text())
    theirs = json.loads((hf_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "vocab_size"):
        assert ours[key] == theirs[key], key
    gen = json.loads((work / "run" / "exported" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    # From another directory: the run's recorded tokenizer and template (DIR's own) still load.
    chat = [sys.executable, "-m", "agentrefine_jax.inference", "generate", "--checkpoint", str(work / "run"),
            "--prompt", "Hello", "--max-new-tokens", "3", "--json"]  # fmt: skip
    r = subprocess.run(chat, cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # The exported HF directory: its own template is the default too (no --template).
    chat[chat.index("--checkpoint") + 1] = str(work / "run" / "exported")
    r = subprocess.run(chat, cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
