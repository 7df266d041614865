"""Config files, name resolution and typed `--set` overrides."""

import pytest

from agentrefine_jax import config_checks
from agentrefine_jax.config import (
    CONFIGS_DIR,
    Config,
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    to_dict,
)


@pytest.mark.parametrize(
    "name,max_length,loss_on,drop",
    [
        ("llama3_8b", 8192, ("correct", "refinement"), False),
        ("mistral_7b", 8192, ("correct", "refinement"), False),
        ("llama3_70b", 4096, ("correct", "refinement"), False),
        ("ablation_no_refinement_loss", 8192, ("correct",), False),
        ("ablation_erroneous_loss", 8192, ("correct", "refinement", "erroneous"), False),
        ("ablation_no_refinement_data", 8192, ("correct", "refinement"), True),
    ],
)
def test_paper_configs(name, max_length, loss_on, drop):
    cfg = load_config(name)
    assert cfg.data.max_length == max_length
    assert cfg.data.loss_on == loss_on and cfg.data.drop_refinement_data is drop
    assert (cfg.optim.learning_rate, cfg.optim.schedule, cfg.optim.warmup_steps) == (5e-6, "cosine", 0)
    assert (cfg.train.global_batch_size, cfg.train.num_epochs) == (64, 10)


def test_path_and_bare_name_resolve_to_the_same_config():
    assert to_dict(load_config(str(CONFIGS_DIR / "tiny.py"))) == to_dict(load_config("tiny"))


def test_overrides_are_typed():
    cfg = load_config(
        "tiny",
        [
            "train.max_steps=7",
            "train.run_dir=/tmp/x",
            "train.checkpoint_every=3",
            "optim.learning_rate=1e-4",
            "data.loss_on=correct",
            "model.scan_layers=false",
            "train.micro_batch_size=none",
            'data.field_map={"turns": "conv"}',
        ],
    )
    assert cfg.train.max_steps == 7 and cfg.train.run_dir == "/tmp/x" and cfg.train.checkpoint_every == 3
    assert cfg.optim.learning_rate == 1e-4 and cfg.data.loss_on == ("correct",)
    assert cfg.model.scan_layers is False and cfg.train.micro_batch_size is None
    assert cfg.data.field_map == {"turns": "conv"}


@pytest.mark.parametrize(
    "override,error",
    [
        ("train.max_step=3", KeyError),  # typo: unknown key
        ("train.max_steps=three", ValueError),
        ("model.scan_layers=maybe", ValueError),
        ("train.max_steps", ValueError),  # no '='
        ("model.remat_policy=everything", ValueError),  # validated by ModelConfig
    ],
)
def test_bad_overrides_fail_at_start_up(override, error):
    with pytest.raises(error):
        apply_overrides(load_config("tiny"), [override])


def test_unknown_config_name_lists_the_choices():
    with pytest.raises(FileNotFoundError, match="demo"):
        load_config("no_such_config")


def test_resolved_config_round_trips_through_json_dict():
    cfg = load_config("llama3_70b", ["train.max_steps=5"])
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)
    assert from_dict(to_dict(cfg)).model == cfg.model


# ---------------------------------------------------------------------------- load-time validation


@pytest.mark.parametrize(
    "override,named",
    [
        ("optim.learning_rate=-1", "optim.learning_rate=-1.0: must be > 0"),
        ("optim.learning_rate=nan", "optim.learning_rate=nan"),
        ("optim.schedule=cosin", "optim.schedule='cosin': must be one of cosine, constant"),
        ("optim.warmup_steps=-1", "optim.warmup_steps"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.grad_clip_norm=-1", "optim.grad_clip_norm"),
        ("optim.b2=1.0", "optim.b2"),
        ("train.max_steps=-3", "train.max_steps=-3"),
        ("train.max_steps=0", "train.max_steps=0"),
        ("train.num_epochs=0", "train.num_epochs"),
        ("train.log_every=0", "train.log_every=0: must be >= 1"),
        ("train.eval_every=-1", "train.eval_every"),
        ("train.checkpoint_every=-5", "train.checkpoint_every"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints"),
        ("train.global_batch_size=0", "train.global_batch_size"),
        ("train.micro_batch_size=3", "train.micro_batch_size=3: must divide train.global_batch_size=4"),
        ("train.loss_chunk_size=0", "train.loss_chunk_size"),
        ("train.export_dtype=float8", "train.export_dtype='float8': must be one of auto, float32"),
        ("train.run_dir=", "train.run_dir"),
        ("data.loss_on=correct,wrong", "data.loss_on"),
        ("data.loss_on=", "data.loss_on=()"),
        ("data.overlength=cut", "data.overlength='cut': must be one of truncate, drop"),
        ("data.format=alpaca", "data.format='alpaca'"),
        ("data.template=chatml", "data.template='chatml'"),
        ("data.max_length=0", "data.max_length"),
        ("data.eval_fraction=1.5", "data.eval_fraction"),
        ("data.max_skip_fraction=2", "data.max_skip_fraction"),
        ("mesh.tensor=0", "mesh.tensor=0: must be -1 (all remaining devices) or >= 1"),
        ("mesh.data=-1", "mesh.data=-1, mesh.fsdp=-1: at most one mesh axis may be -1"),
        ("mesh.data=-2", "mesh.data=-2"),
        ('mesh.rules=[["batch", "dta"]]', "mesh.rules: 'batch' -> 'dta'"),
        ("model.num_layers=0", "model.num_layers"),
        ("model.rms_norm_eps=0", "model.rms_norm_eps"),
        ("model.sliding_window=0", "model.sliding_window"),
    ],
)
def test_bad_values_are_refused_at_load_time_naming_the_key(override, named):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    msg = str(e.value)
    assert named in msg and "\n" not in msg


def test_optim_warmup_must_fit_in_max_steps():
    with pytest.raises(ConfigError, match=r"optim.warmup_steps=30: must be < train.max_steps=30"):
        load_config("tiny", ["optim.warmup_steps=30"])
    assert load_config("tiny", ["optim.warmup_steps=30", "optim.schedule=constant"]).optim.warmup_steps == 30


def test_every_bad_key_is_named_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["optim.learning_rate=0", "train.log_every=0"])
    assert "optim.learning_rate=0.0" in str(e.value) and "train.log_every=0" in str(e.value)


def test_edge_values_that_mean_off_are_accepted():
    cfg = load_config(
        "tiny",
        [
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "optim.grad_clip_norm=0",
            "train.max_steps=none",
            "train.export_dtype=auto",
            "mesh.fsdp=1",
            "mesh.data=-1",
        ],
    )
    assert cfg.train.max_steps is None and cfg.mesh.data == -1


def test_wrong_types_in_a_config_file_are_refused(tmp_path):
    """A config file is Python: a string where a number belongs must not reach the trainer."""
    path = tmp_path / "bad.py"
    path.write_text(
        "import dataclasses\n"
        "from agentrefine_jax.config import load_config\n"
        "def config():\n"
        "    cfg = load_config('demo')\n"
        "    train = dataclasses.replace(cfg.train, max_steps='10', seed=True)\n"
        "    return dataclasses.replace(cfg, train=train)\n"
    )
    with pytest.raises(ConfigError, match=r"train.max_steps='10': must be an integer.*train.seed=True"):
        load_config(str(path))


def test_a_single_name_where_a_list_of_names_belongs_is_accepted_as_before(tmp_path):
    path = tmp_path / "one_file.py"
    path.write_text(
        "import dataclasses\n"
        "from agentrefine_jax.config import load_config\n"
        "def config():\n"
        "    cfg = load_config('demo')\n"
        "    data = dataclasses.replace(cfg.data, train_files='x.jsonl', loss_on='correct,refinement')\n"
        "    return dataclasses.replace(cfg, data=data)\n"
    )
    assert load_config(str(path)).data.train_files == "x.jsonl"
    path.write_text(path.read_text().replace("correct,refinement", "correct,wrong"))
    with pytest.raises(ConfigError, match="data.loss_on='correct,wrong'"):
        load_config(str(path))


def test_a_broken_config_file_is_one_config_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def config(:\n")
    with pytest.raises(ConfigError, match=r"broken.py failed: SyntaxError"):
        load_config(str(path))
    path.write_text("X = 1\n")
    with pytest.raises(ConfigError, match=r"must define `def config\(\) -> Config`"):
        load_config(str(path))


@pytest.mark.parametrize(
    "override,named",
    [
        ("train.max_steps=three", "--set train.max_steps=three: expected an integer"),
        ("model.scan_layers=maybe", "--set model.scan_layers=maybe: expected true or false"),
        ("model.remat_policy=everything", "--set model.remat_policy=everything: remat_policy must be"),
        ("model.param_dtype=float8", "--set model.param_dtype=float8"),
        ('model.rope_scaling={"fator": 2}', "--set model.rope_scaling="),
        ("data.field_map=[1]", "--set data.field_map=[1]: expected a JSON object"),
        ("data.field_map={bad", "--set data.field_map={bad"),
    ],
)
def test_unparseable_overrides_name_the_key(override, named):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert str(e.value).startswith(named) and "\n" not in str(e.value)


def test_every_rule_names_an_existing_field_and_shipped_configs_pass():
    cfg = Config()
    for key in config_checks.RULES:
        config_checks.lookup(cfg, key)  # AttributeError: a rule for a field that does not exist
    for path in CONFIGS_DIR.glob("*.py"):
        if not path.stem.startswith("_"):
            load_config(path.stem)  # validated on load


def test_closed_sets_match_the_modules_that_own_them():
    from agentrefine_jax.data import examples, templates
    from agentrefine_jax.hf import io as hf_io

    assert config_checks.TEMPLATES == templates.TEMPLATES
    from agentrefine_jax.data import schema

    assert config_checks.DATA_FORMATS == schema.FORMATS
    assert config_checks.OVERLENGTH_MODES == examples.OVERLENGTH_MODES
    assert set(config_checks.DTYPES) == set(hf_io.NP_DTYPES)
    for schedule in config_checks.SCHEDULES:  # every accepted schedule builds
        from agentrefine_jax.config import OptimConfig
        from agentrefine_jax.train.optimizer import learning_rate_schedule

        learning_rate_schedule(OptimConfig(schedule=schedule), 10)


@pytest.mark.parametrize("order", [0, 1])
def test_overrides_are_applied_together_then_checked_once(order):
    """heads 4->9 with kv-heads 2->3 is valid only as a pair: either order works, and a set that
    stays invalid is refused naming its key."""
    sets = ["model.num_heads=9", "model.num_kv_heads=3"][:: 1 if order else -1]
    cfg = load_config("tiny", sets)
    assert (cfg.model.num_heads, cfg.model.num_kv_heads) == (9, 3)
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["model.num_heads=9", "train.max_steps=3"])
    assert str(e.value).startswith("--set model.num_heads=9: num_heads=9 must be a multiple")
