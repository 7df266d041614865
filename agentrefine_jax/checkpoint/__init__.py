"""The project checkpoint format, shared by `export`, `inference` and the trainer.

A checkpoint *root* is an `orbax.checkpoint.CheckpointManager` directory; every numeric
subdirectory is one step, holding at least two items:

  params  StandardSave of the parameter tree as a plain nested dict
          (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`), arrays in their param dtype;
  meta    JsonSave of the step's `CheckpointMeta` (meta.py: model config, tokenizer, template,
          the run's config, step, run facts, the LoRA reference).

A LoRA run's steps (`meta.lora` set) hold only the adapters in `params`; `load_model` rebuilds
the frozen base from its reference (lora_base.py) and merges them. The trainer adds `opt_state`
(its optimizer state) to the same steps, through the same manager (train_state.py); loaders read
only `params` and `meta` and ignore everything else (older runs also hold a `data_iter` item, no
longer needed: the data position is the global step). Every step carries a checksum manifest
(integrity.py).

One concern per module:
  format.py       the layout: item names, the Orbax manager, finding a step, the tree check
  meta.py         `CheckpointMeta` / `LoraMeta`: the typed meta item (the JSON is unchanged)
  integrity.py    manifests, verification, the newest intact step, opening a verified step
  model.py        `save_model` / `load_model`
  lora_base.py    a LoRA base's reference, identity, rebuild (`rebuild_base`); `load_lora`, `load_merged`,
                  `load_handoff` (the adapters on the user's base: what the exports hand off)
  train_state.py  the trainer's save/restore, background saves (`TrainCheckpoints`), resume choice
"""

from agentrefine_jax.checkpoint.format import (
    ITEM_META,
    ITEM_OPT_STATE,
    ITEM_PARAMS,
    RUN_CHECKPOINTS_SUBDIR,
    checkpoint_steps,
    compare_trees,
    handler_registry,
    manager,
    resolve_checkpoint,
)
from agentrefine_jax.checkpoint.integrity import (
    MANIFEST,
    ORBAX_COMMIT_FILE,
    CheckpointIntegrityError,
    newest_intact_step,
    open_step,
    orbax_commit_problem,
    params_fingerprint,
    verify_step,
    write_manifest,
)
from agentrefine_jax.checkpoint.lora_base import (
    base_config,
    base_rounding,
    check_lora_base,
    load_handoff,
    load_lora,
    lora_base_identity,
    lora_reference,
    rebuild_base,
    shapes_digest,
    trained_base_rounding,
    weights_digest,
)
from agentrefine_jax.checkpoint.meta import (
    CheckpointMeta,
    LoraBase,
    LoraMeta,
    make_meta,
    model_config_from_meta,
    read_meta,
)
from agentrefine_jax.checkpoint.model import check_params, load_model, params_pure_dict, save_model
from agentrefine_jax.checkpoint.train_state import (
    CheckpointSaveError,
    TrainCheckpoints,
    choose_resume_step,
    restore_train_state,
    save_train_state,
)

__all__ = [
    "ITEM_META",
    "ITEM_OPT_STATE",
    "ITEM_PARAMS",
    "MANIFEST",
    "ORBAX_COMMIT_FILE",
    "RUN_CHECKPOINTS_SUBDIR",
    "CheckpointIntegrityError",
    "CheckpointMeta",
    "CheckpointSaveError",
    "LoraBase",
    "LoraMeta",
    "TrainCheckpoints",
    "base_config",
    "base_rounding",
    "check_lora_base",
    "check_params",
    "checkpoint_steps",
    "choose_resume_step",
    "compare_trees",
    "handler_registry",
    "load_handoff",
    "load_lora",
    "load_model",
    "lora_base_identity",
    "lora_reference",
    "make_meta",
    "manager",
    "model_config_from_meta",
    "newest_intact_step",
    "open_step",
    "orbax_commit_problem",
    "params_fingerprint",
    "params_pure_dict",
    "read_meta",
    "rebuild_base",
    "resolve_checkpoint",
    "restore_train_state",
    "save_model",
    "save_train_state",
    "shapes_digest",
    "trained_base_rounding",
    "verify_step",
    "weights_digest",
    "write_manifest",
]
