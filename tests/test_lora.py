"""LoRA refinement tuning (train.lora): adapters only are trained and checkpointed, a fresh
adapter is the identity, runs learn and resume exactly, and exports load in peft + transformers."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from test_train_loop import REPO, _env, _finish, _losses, _train

from agentrefine_jax import sharding as shd
from agentrefine_jax.checkpoint import shapes_digest
from agentrefine_jax.config import MeshConfig, OptimConfig
from agentrefine_jax.models import create, lora, preset
from agentrefine_jax.train.optimizer import make_optimizer
from agentrefine_jax.train.step import build_steps

VOCAB = 512
CFG = preset("tiny", vocab_size=VOCAB, param_dtype="float32", dtype="float32")
SPEC = lora.LoraSpec(("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8.0)
LORA = ["--set", "train.lora.rank=8", "--set", "train.lora.dropout=0.1", "--set", "optim.learning_rate=0.01"]


def _batch(b: int = 4, s: int = 32) -> dict[str, jax.Array]:
    rng = np.random.RandomState(0)
    return {
        "input_ids": jnp.asarray(rng.randint(0, VOCAB, (b, s)), jnp.int32),
        "loss_mask": jnp.ones((b, s), jnp.int32),
        "segment_ids": jnp.ones((b, s), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
    }


@pytest.mark.parametrize(
    "bad, says",
    [
        ("train.lora.rank=-1", "train.lora.rank=-1: must be >= 0"),
        ("train.lora.targets=q,x", "must be a non-empty subset of q, k, v, o, gate, up, down"),
        ("train.lora.dropout=1", "train.lora.dropout=1.0: must be in [0, 1)"),
        ("train.lora.base_dtype=fp8", "must be one of bfloat16, float32, int8"),
    ],
)
def test_bad_lora_settings_are_refused_at_load_time(bad, says):
    from agentrefine_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("tiny", ["train.lora.rank=8", bad])


def test_fresh_adapters_leave_the_forward_unchanged():
    model = create(CFG, seed=0)
    adapters = lora.init(SPEC, CFG, jax.random.key(1))
    assert all(float(jnp.abs(ab["a"]).max()) > 0 and not jnp.any(ab["b"]) for ab in adapters.values())
    ids = _batch()["input_ids"]
    base, _ = model.forward(ids)
    with_lora, _ = model.forward(ids, adapters=(SPEC, adapters, None))
    np.testing.assert_array_equal(np.asarray(base), np.asarray(with_lora))


def test_lora_forward_equals_the_merged_weights():
    model = create(CFG, seed=0)
    adapters = jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(x.size), x.shape) * 0.05,
        lora.init(SPEC, CFG, jax.random.key(1)),
    )
    merged = lora.merge(nnx.to_pure_dict(nnx.state(model, nnx.Param)), adapters, SPEC)
    graphdef, state = nnx.split(model, nnx.Param)
    nnx.replace_by_pure_dict(state, merged)
    ids = _batch()["input_ids"]
    got, _ = model.forward(ids, adapters=(SPEC, adapters, None))
    want, _ = nnx.merge(graphdef, state).forward(ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert float(jnp.abs(want - model.forward(ids)[0]).max()) > 1e-3  # the adapters do something


def test_lora_loss_on_a_packed_masked_batch_is_the_merged_models_per_example_masked_loss():
    """Refinement masks and packing are unchanged under LoRA: the training loss (adapters applied in
    the forward) on a packed batch equals the merged-weights model run on each example alone,
    counting only the unmasked (correct / refinement) tokens of that example."""
    from agentrefine_jax.models.llama import abstract_params
    from agentrefine_jax.train.step import loss_sums

    rng = np.random.RandomState(1)
    # Two rows of 32: [example 12 | example 14 | padding 6] and [example 20 | example 12].
    lengths = [[12, 14], [20, 12]]
    s = 32
    ids = rng.randint(0, VOCAB, (2, s)).astype(np.int32)
    seg, pos = np.zeros((2, s), np.int32), np.zeros((2, s), np.int32)
    mask = (rng.rand(2, s) > 0.4).astype(np.int32)  # zeros: the erroneous turns' tokens (and prompts)
    for r, row in enumerate(lengths):
        start = 0
        for k, n in enumerate(row):
            seg[r, start : start + n], pos[r, start : start + n] = k + 1, np.arange(n)
            start += n
    mask[seg == 0] = 0
    batch = {k: jnp.asarray(v) for k, v in (("input_ids", ids), ("loss_mask", mask))}
    batch |= {"segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}

    model = create(CFG, seed=0)
    adapters = jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(x.size), x.shape) * 0.05,
        lora.init(SPEC, CFG, jax.random.key(1)),
    )
    base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    graphdef, _ = abstract_params(CFG)
    packed = jax.jit(lambda p, spec: loss_sums(graphdef, p, batch, 16, "remat", spec), static_argnums=1)
    got, n_got = packed({"base": base, "lora": adapters}, SPEC)
    base_only, _ = packed(base, None)

    # The oracle: each example alone (right-padded to 20: causal attention ignores what follows).
    starts = [np.cumsum([0, *row[:-1]]) for row in lengths]
    examples = [(r, int(starts[r][k]), n) for r, row in enumerate(lengths) for k, n in enumerate(row)]
    alone = np.zeros((len(examples), 20), np.int32)
    for i, (r, start, n) in enumerate(examples):
        alone[i, :n] = ids[r, start : start + n]
    merged = nnx.merge(graphdef, lora.merge(base, adapters, SPEC))
    logp = np.asarray(
        jax.nn.log_softmax(jax.jit(lambda x: merged(x))(jnp.asarray(alone)), axis=-1), np.float64
    )
    want, n_want = 0.0, 0
    for i, (r, start, n) in enumerate(examples):
        counted = mask[r, start + 1 : start + n] > 0  # position t predicts token t + 1
        picked = np.take_along_axis(logp[i, : n - 1], ids[r, start + 1 : start + n, None], -1)[:, 0]
        want -= float(picked[counted].sum())
        n_want += int(counted.sum())
    assert int(n_got) == n_want < int(np.sum(seg > 0)) - 4  # masked tokens and segment starts drop out
    np.testing.assert_allclose(float(got), want, rtol=2e-5)
    assert abs(float(base_only) - want) > 1e-3 * abs(want)  # the adapters change this loss


def test_only_adapters_are_differentiated_updated_and_in_the_optimizer_state():
    mesh = shd.make_mesh(1, -1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(OptimConfig(learning_rate=1e-2, schedule="constant"), 10)
    fns = build_steps(
        CFG,
        optimizer,
        mesh,
        MeshConfig().rules,
        global_batch=4,
        micro_batch=2,
        loss_chunk=16,
        lora_spec=SPEC,
        lora_base_dtype="float32",
    )
    params = fns.init_params(0)
    opt_state = fns.init_opt(params)
    # Optimizer moments exist for adapters only: no base tensor is held twice more.
    adam = optax.tree_utils.tree_get(opt_state, "mu")
    assert jax.tree.structure(adam) == jax.tree.structure(params["lora"])
    n_opt = sum(x.size for x in jax.tree.leaves(opt_state))
    n_lora = sum(x.size for x in jax.tree.leaves(params["lora"]))
    assert n_opt < 2 * n_lora + 10 < sum(x.size for x in jax.tree.leaves(params["base"]))
    base_before = jax.tree.map(np.asarray, params["base"])
    lora_before = jax.tree.map(np.asarray, params["lora"])
    new, _, metrics = fns.train(params, opt_state, _batch())
    assert np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new["base"]), base_before)
    for name in SPEC.names:  # B moves off zero; every target learned something
        assert float(np.abs(np.asarray(new["lora"][name]["b"])).max()) > 0
        assert not np.array_equal(np.asarray(new["lora"][name]["b"]), lora_before[name]["b"])


# ------------------------------------------------------------------------------ end to end


def train_demo(run_dir: pathlib.Path, *args: str) -> pathlib.Path:
    """The demo trained 8 steps with `args` (a LoRA setting) in `run_dir`."""
    code, out = _finish(_train(run_dir, *args))
    assert code == 0, out
    return run_dir


def check_learned_with_adapters_only(run_dir: pathlib.Path) -> dict:
    """The run's loss fell and its last checkpoint holds the adapters only; returns its meta."""
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (6, 7, 8)])
    assert last < first - 0.05, losses
    step = run_dir / "checkpoints" / "8"
    tree = ocp.StandardCheckpointHandler().metadata(step / "params").tree
    assert set(tree) == set(SPEC.names)  # adapters, no embedding / base projections
    return json.loads((step / "meta" / "metadata").read_text())


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> pathlib.Path:
    return train_demo(tmp_path_factory.mktemp("lora") / "run", *LORA)


def test_lora_demo_learns_and_checkpoints_hold_only_adapters(lora_run):
    meta = check_learned_with_adapters_only(lora_run)
    assert meta["lora"]["rank"] == 8 and meta["lora"]["base"]["seed"] == 0
    assert meta["lora"]["base"]["shapes"] == shapes_digest(preset("tiny"))  # the base's identity


def test_resumed_lora_run_is_exact(lora_run, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(lora_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "8")  # as if killed after step 6's save
    rows = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text(
        "\n".join(r for r in rows if json.loads(r).get("step", 0) <= 6) + "\n"
    )
    code, out = _finish(_train(resumed, *LORA))
    assert code == 0, out
    assert f"resumed from {resumed}/checkpoints/6" in out
    assert _losses(resumed) == _losses(lora_run)
    read = ocp.StandardCheckpointHandler()
    a = ocp.Checkpointer(read).restore(lora_run / "checkpoints" / "8" / "params")
    b = ocp.Checkpointer(read).restore(resumed / "checkpoints" / "8" / "params")
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _export(run: pathlib.Path, out: pathlib.Path, *flags: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "agentrefine_jax.export",
        "to-hf",
        "--checkpoint",
        str(run),
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [*cmd, *flags], cwd=REPO, env=_env(out), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr


def test_peft_loads_the_adapter_export_with_our_logits_and_merged_export_agrees(lora_run, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from agentrefine_jax.checkpoint import load_model

    _export(lora_run, tmp_path / "adapter")
    _export(lora_run, tmp_path / "merged", "--merge-lora")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base" and config["r"] == 8
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()

    ids = np.random.RandomState(0).randint(0, 128000, (2, 48))
    with torch.no_grad():
        theirs = peft_model(torch.as_tensor(ids)).logits.numpy()
        from_merged = merged(torch.as_tensor(ids)).logits.numpy()
    _, model, _ = load_model(lora_run, dtype="float32", param_dtype="float32")
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    with torch.no_grad(), peft_model.disable_adapter():  # peft wraps `base` in place
        base_only = peft_model(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(theirs - base_only).max() > 1e-3  # the adapters change the logits
    assert np.abs(theirs - ours).max() <= 1e-4
    assert np.abs(from_merged - theirs).max() <= 1e-4


def test_verify_checks_the_adapter_export_with_peft_on_its_base(lora_run, tmp_path):
    """`export verify --hf ADAPTER`: peft runs the adapter export on the base it names, against
    the run's hand-off; a random base is the run's own (nothing rounded: no trained-model line)."""
    pytest.importorskip("peft")
    _export(lora_run, tmp_path / "adapter")
    proc = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.export", "verify", "--checkpoint", str(lora_run)]
        + ["--hf", str(tmp_path / "adapter"), "--seq-lens", "16,32", "--json"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("PASS (float32 compute)") and len(lines) == 2, proc.stdout
    result = json.loads(lines[1])
    assert result["max_abs_diff"] <= 1e-4 and result["base_rounding"] is None
    assert result["trained_vs_handoff"] is None


def test_base_dtype_follows_the_model_unless_asked():
    """train.lora.base_dtype defaults to the model's param_dtype (a float32 model keeps a float32
    base); bfloat16/int8 are asked for, as the TPU presets do (for memory); the planner follows."""
    from agentrefine_jax.checkpoint import lora_reference
    from agentrefine_jax.config import load_config
    from agentrefine_jax.train import planner
    from agentrefine_jax.train.param_mode import ParamMode

    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    cfg = load_config("tiny", ["train.lora.rank=4"])
    assert cfg.model.param_dtype == "float32" and cfg.train.lora.base_dtype == "auto"
    ref = lora_reference(cfg)
    assert (ref.base_dtype, ref.base_rounding) == ("float32", None)
    assert ParamMode.of(cfg).model_cfg.param_dtype == "float32"
    plan = planner.plan(cfg, sizes, "v5p", global_batch=2, seq_len=128)
    assert plan["base_dtype"] == "float32"
    low = load_config("tiny", ["train.lora.rank=4", "model.param_dtype=bfloat16"])
    assert ParamMode.of(low).model_cfg.param_dtype == lora_reference(low).base_dtype == "bfloat16"
    asked = load_config("tiny", ["train.lora.rank=4", "train.lora.base_dtype=bfloat16"])
    assert ParamMode.of(asked).model_cfg.param_dtype == lora_reference(asked).base_dtype == "bfloat16"
    asked_plan = planner.plan(asked, sizes, "v5p", global_batch=2, seq_len=128)
    assert asked_plan["base_dtype"] == "bfloat16"
    assert asked_plan["bytes_per_device"]["params"] < plan["bytes_per_device"]["params"]
    for name in ("llama3_8b_lora", "llama3_70b_lora"):  # float32 models, bfloat16 bases by choice
        preset_cfg = load_config(name)
        assert preset_cfg.model.param_dtype == "float32" and preset_cfg.train.lora.base_dtype == "bfloat16"


def test_base_rounding_is_what_base_dtype_does_to_the_stored_weights(tmp_path):
    """(stored, held) when holding an HF base in base_dtype rounds or quantises any of its
    tensors; None when it keeps them all exactly, or the base came from no directory."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from agentrefine_jax.checkpoint import LoraBase, base_rounding

    def base(name: str, **dtypes) -> LoraBase:
        (tmp_path / name).mkdir()
        save_file({k: torch.zeros(2, dtype=getattr(torch, d)) for k, d in dtypes.items()},
                  tmp_path / name / "model.safetensors")  # fmt: skip
        return LoraBase(init_from_hf=str(tmp_path / name))

    f32, bf16 = base("f32", w="float32"), base("bf16", w="bfloat16")
    mixed = base("mixed", w="bfloat16", norm="float32")  # one float32 tensor is rounded too
    assert base_rounding(f32, "bfloat16") == ("float32", "bfloat16")
    assert base_rounding(f32, "int8") == ("float32", "int8")
    assert base_rounding(f32, "float32") is None
    assert base_rounding(bf16, "bfloat16") is None and base_rounding(bf16, "int8") == ("bfloat16", "int8")
    assert base_rounding(mixed, "bfloat16") == ("float32", "bfloat16")
    assert base_rounding(LoraBase(seed=0), "bfloat16") is None


def test_lora_step_compiles_for_tpu_with_base_outside_the_optimizer_state():
    """The XLA TPU compiler (libtpu) on the tiny demo: a LoRA step's arguments are the bfloat16
    base plus float32 adapters and their moments, far below full fine-tuning's params + moments."""
    pytest.importorskip("libtpu", reason="the TPU compile check needs the tpu extra (libtpu)")
    tiny = [
        "--set",
        "model.num_layers=1",
        "--set",
        "data.max_length=128",
        "--set",
        "train.loss_chunk_size=64",
    ]
    args = {}
    lora_bf16 = ["--set", "train.lora.rank=8", "--set", "train.lora.base_dtype=bfloat16"]  # tiny is float32
    for name, extra in (("full", []), ("lora", lora_bf16)):
        cmd = [sys.executable, "-m", "agentrefine_jax.plan", "--config", "tiny", "--topology", "v5p-8"]
        proc = subprocess.run(
            [*cmd, "--compile", "--json", *tiny, *extra], capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        args[name] = json.loads(proc.stdout)["compiled"]["bytes_per_device"]["arguments"]
    # full: float32 params + 2 float32 moments = 12 bytes/weight; LoRA: a 2-byte base (+ adapters).
    assert args["lora"] < args["full"] / 4, args
