"""Config files, name resolution and typed `--set` overrides."""

import pytest

from agentrefine_jax.config import CONFIGS_DIR, apply_overrides, from_dict, load_config, to_dict


@pytest.mark.parametrize(
    "name,max_length,loss_on,drop",
    [
        ("llama3_8b", 8192, ("correct", "refinement"), False),
        ("mistral_7b.py", 8192, ("correct", "refinement"), False),
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
    assert to_dict(load_config(str(CONFIGS_DIR / "demo.py"))) == to_dict(load_config("demo"))


def test_overrides_are_typed():
    cfg = load_config(
        "demo",
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
        apply_overrides(load_config("demo"), [override])


def test_unknown_config_name_lists_the_choices():
    with pytest.raises(FileNotFoundError, match="demo"):
        load_config("no_such_config")


def test_resolved_config_round_trips_through_json_dict():
    cfg = load_config("llama3_70b", ["train.max_steps=5"])
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)
    assert from_dict(to_dict(cfg)).model == cfg.model
