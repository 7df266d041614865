"""What the train step holds and differentiates: full fine-tuning, LoRA, or LoRA on an int8 base.

One object answers every question that differs between the three modes — how parameters are
initialised and sharded, their abstract shapes, which subset the optimizer updates (and a
checkpoint stores), how that subset re-enters the full parameters, and the loss function over
it — so `step.build_steps` reads straight through without branching on LoRA.

Full: params are the model's pure dict; all of it is trained.
LoRA: params are {"base": frozen model params, "lora": adapters}; only the adapters are
differentiated (the base enters the loss as a constant). Dropout keys come from the
optimizer's update count, so a resumed run draws the same masks.
int8 LoRA: as LoRA, with the base's projections stored as int8 + per-channel scales
(models/quant.py), quantised by one jitted function shared with the HF-import path.

The trainer's loop asks it too: the fresh params (seeded, from `train.init_from_hf`, or a LoRA
run's frozen base rebuilt from its reference with fresh adapters), the params a checkpoint
restores into, what a checkpoint's meta records about them and whether a resume may use it.
A LoRA checkpoint's stored form (reference, identity, rebuild, load for merge/export) is
checkpoint/lora_base.py, below the trainer, shared with every loader.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from agentrefine_jax import objective_table
from agentrefine_jax import sharding as shd
from agentrefine_jax.checkpoint import (
    CheckpointMeta,
    LoraBase,
    base_config,
    check_lora_base,
    lora_reference,
    rebuild_base,
)
from agentrefine_jax.config import Config
from agentrefine_jax.models import execution, llama, lora, quant
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.train.run_dir import TrainingInputError

Params = dict[str, Any]
log = logging.getLogger("agentrefine_jax.train")
# A step's loss over the trained subset: (trained, micro batch, dropout key) -> ((loss sum, tokens), ...)
LossFn = Callable[[Params, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class ParamMode:
    model_cfg: ModelConfig  # the stored model (a LoRA base in its own dtype)
    merged_dtype: str  # model.param_dtype: what a merged LoRA model is cast to
    lora_spec: lora.LoraSpec | None = None
    int8: bool = False
    # Full fine-tuning with a DPO reference: params are {"model": trained, "ref": a frozen copy of
    # the starting weights}; only "model" is trained, saved and exported. (LoRA's reference is its
    # base with the adapters off: no copy.)
    reference: bool = False

    @classmethod
    def of(cls, cfg: Config) -> ParamMode:
        """The run's mode, from its config (`train.lora`, `train.objective`)."""
        mode = cls.of_settings(cfg.model, lora.LoraSpec.of(cfg.train.lora), cfg.train.lora.base_dtype)
        objective = cfg.train.objective
        return mode.for_objective(objective, objective_table.get(objective).reference_in(cfg))

    def for_objective(self, objective: str, reference: bool | None = None) -> ParamMode:
        """This mode, holding a frozen reference copy when a full fine-tuning objective needs one
        (its objective table entry says so — `reference`, when given, is the entry's answer for the
        run's knobs, objective_table.Objective.reference_in; a LoRA run's reference is its base,
        adapters off)."""
        if reference is None:
            reference = objective_table.get(objective).holds_reference()
        if self.lora_spec is None and reference and not self.reference:
            return dataclasses.replace(self, reference=True)
        return self

    @classmethod
    def of_settings(
        cls, model_cfg: ModelConfig, lora_spec: lora.LoraSpec | None, base_dtype: str | None
    ) -> ParamMode:
        merged = model_cfg.param_dtype
        if lora_spec is not None and base_dtype:  # the frozen base is stored in its own dtype
            base_dtype = lora.resolve_base_dtype(base_dtype, merged)
            model_cfg = dataclasses.replace(model_cfg, param_dtype=quant.storage_dtype(base_dtype))
        return cls(model_cfg, merged, lora_spec, lora_spec is not None and base_dtype == "int8")

    @property
    def name(self) -> str:
        return "full" if self.lora_spec is None else ("int8-lora" if self.int8 else "lora")

    # ------------------------------------------------------------------ parameters

    def init_base(self, seed: int) -> Params:
        from agentrefine_jax.models import create

        return nnx.to_pure_dict(nnx.state(create(self.model_cfg, seed), nnx.Param))

    def init_adapters(self, seed: int) -> Params:
        # Its own stream: the base drawn from `seed` is the same with or without LoRA.
        return lora.init(self.lora_spec, self.model_cfg, jax.random.fold_in(jax.random.key(seed), 0x10A))

    def build(self, mesh: Mesh, rules: shd.Rules) -> Built:
        """Jitted initialisers, shardings and abstract shapes on `mesh`; the graphdef carries the
        execution plan for `mesh`'s devices (models/execution.py), decided here once."""
        plan = execution.for_devices(self.model_cfg, mesh)
        graphdef, abs_state = llama.abstract_params(self.model_cfg, plan)
        base_shard = shd.param_shardings(abs_state, mesh, rules)
        init = jax.jit(self.init_base, static_argnums=0, out_shardings=base_shard)
        with shd.use_sharding(mesh, rules):
            abstract = jax.eval_shape(lambda: self.init_base(0))
        prepare_base = init_adapters = None
        if self.int8:
            # A separate jit on the materialised bfloat16 base: the HF-import path and
            # checkpoint.load_lora quantise the same arrays the same way.
            prepare_base = jax.jit(quant.quantize_base, out_shardings=quant.shardings(base_shard))
            float_init, base_shard = init, quant.shardings(base_shard)
            init = lambda seed: prepare_base(float_init(seed))  # noqa: E731
            abstract = jax.eval_shape(quant.quantize_base, abstract)
        shardings = base_shard
        init_model = copy = None
        if self.reference:
            init_model = init
            copy = jax.jit(lambda t: jax.tree.map(jax.numpy.copy, t), out_shardings=base_shard)
            init = lambda seed: self._with_reference(init_model(seed), copy)  # noqa: E731
            shardings = {"model": base_shard, "ref": base_shard}
            abstract = {"model": abstract, "ref": abstract}
        if self.lora_spec is not None:
            a_shard = _lora_shardings(self.lora_spec, self.model_cfg, mesh, rules)
            init_adapters = jax.jit(self.init_adapters, static_argnums=0, out_shardings=a_shard)
            base_init = init
            init = lambda seed: {"base": base_init(seed), "lora": init_adapters(seed)}  # noqa: E731
            shardings = {"base": base_shard, "lora": a_shard}
            with shd.use_sharding(mesh, rules):
                abstract = {"base": abstract, "lora": jax.eval_shape(lambda: self.init_adapters(0))}
        return Built(graphdef, shardings, abstract, init, init_adapters, prepare_base, init_model, copy)

    @staticmethod
    def _with_reference(model: Params, copy: Callable[[Params], Params]) -> Params:
        # A copy, not the same buffers: the step donates "model" and keeps "ref".
        return {"model": model, "ref": copy(model)}

    # ------------------------------------------------------------------ training

    def trainable(self, tree: Any) -> Any:
        """What the optimizer updates and a checkpoint stores: all params, or the adapters."""
        if self.reference:
            return tree["model"]
        return tree["lora"] if self.lora_spec is not None else tree

    def with_trained(self, params: Params, trained: Params) -> Params:
        if self.reference:
            return {"model": trained, "ref": params["ref"]}
        return {"base": params["base"], "lora": trained} if self.lora_spec is not None else trained

    def loss(self, loss_sums: Callable[..., Any], graphdef: Any, params: Params, **kw: Any) -> LossFn:
        """The loss over the trained subset (the base, if any, enters as a constant)."""
        if self.reference:
            return lambda p, mb, key: loss_sums(graphdef, {"model": p, "ref": params["ref"]}, mb, **kw)
        if self.lora_spec is None:
            return lambda p, mb, key: loss_sums(graphdef, p, mb, **kw)
        return lambda a, mb, key: loss_sums(
            graphdef, {"base": params["base"], "lora": a}, mb, lora_spec=self.lora_spec, dropout_key=key, **kw
        )

    def dropout_keys(self, opt_state: Any, n: int) -> jax.Array:
        """One key per micro batch, from the optimizer's update count (resume draws the same)."""
        if self.lora_spec is None:
            return jax.numpy.zeros((n,), jax.numpy.uint32)
        count = optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]
        return jax.random.split(jax.random.fold_in(jax.random.key(0x10A), count), n)

    def merged(self, params: Params) -> Params:
        """The model's own params: adapters merged into the base's weights."""
        if self.reference:
            return params["model"]
        if self.lora_spec is None:
            return params
        return lora.merge(params["base"], params["lora"], self.lora_spec, self.merged_dtype)

    def handoff(self, params: Params, cfg: Config, mesh: Mesh) -> Params:
        """The model's params as the run hands them off (`train.export_hf_at_end`): a LoRA run on
        an init_from_hf base merges its adapters in float32 into the directory's weights read
        afresh at their stored precision (as `export to-hf --merge-lora` and PEFT on the adapter
        export do; checkpoint.load_handoff), not into the copy the run held (maybe rounded)."""
        if self.lora_spec is None or not cfg.train.init_from_hf:
            return self.merged(params)
        exact = dataclasses.replace(self.model_cfg, param_dtype="float32")
        source = LoraBase(init_from_hf=cfg.train.init_from_hf)
        base = rebuild_base(source, exact, mesh=mesh, rules=cfg.mesh.rules)
        return lora.merge(base, params["lora"], self.lora_spec, "float32")

    # ------------------------------------------------------------------ a run's checkpoints

    def meta_fields(self, cfg: Config) -> dict[str, Any]:
        """What a checkpoint's meta records beyond the model: a LoRA run's base reference (how to
        rebuild the frozen base exactly, with its identity), since its `params` are the adapters."""
        return {} if self.lora_spec is None else {"lora": lora_reference(cfg)}

    def check_resume(self, stored: CheckpointMeta, now: CheckpointMeta, *, what: str) -> None:
        """Refuse to resume adapters onto another base than the one they were trained on."""
        if now.lora is None:
            return
        try:
            check_lora_base(
                stored.lora.base if stored.lora is not None else LoraBase(), now.lora.base, what=what
            )
        except ValueError as e:
            raise TrainingInputError(str(e)) from None

    def fresh(self, cfg: Config, built: Built, mesh: Mesh, meta: CheckpointMeta) -> Params:
        """Fresh params: the model (seeded, or read from train.init_from_hf); a LoRA run's frozen
        base (the one rebuild loaders use too) with fresh adapters."""
        if self.lora_spec is not None:
            return {"base": self._base(cfg, built, mesh, meta), "lora": built.init_adapters(cfg.train.seed)}
        if self.reference:
            return self._with_reference(self._fresh_model(cfg, built, mesh), built.reference_copy)
        return self._fresh_model(cfg, built, mesh)

    def _fresh_model(self, cfg: Config, built: Built, mesh: Mesh) -> Params:
        if not cfg.train.init_from_hf:
            return (built.init_model or built.init)(cfg.train.seed)
        from agentrefine_jax.hf.io import load_hf_model

        try:  # the weights' contents (NaN/Inf) are checked only here, as they are read
            _, model = load_hf_model(
                cfg.train.init_from_hf, mesh=mesh, rules=cfg.mesh.rules, param_dtype=cfg.model.param_dtype
            )
        except (ValueError, FileNotFoundError) as e:
            raise TrainingInputError(f"train.init_from_hf={cfg.train.init_from_hf}: {e}") from None
        log.info(f"initialised from {cfg.train.init_from_hf}")
        shardings = built.shardings["model"] if self.reference else built.shardings
        return jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)), shardings)

    def restored(
        self, trained: Params, cfg: Config, built: Built, mesh: Mesh, meta: CheckpointMeta
    ) -> Params:
        """The params of a resumed run from its checkpoint's trained subset: a LoRA checkpoint
        holds the adapters, the base is rebuilt from its reference; a DPO reference is the run's
        starting weights again (seeded or train.init_from_hf), rebuilt the same way."""
        if self.reference:
            return {"model": trained, "ref": self._fresh_model(cfg, built, mesh)}
        if self.lora_spec is None:
            return trained
        return {"base": self._base(cfg, built, mesh, meta), "lora": trained}

    def _base(self, cfg: Config, built: Built, mesh: Mesh, meta: CheckpointMeta) -> Params:
        """The frozen base as the trainer holds it (int8: quantised once, here, from the bfloat16 build)."""
        ref = meta.lora
        try:  # an HF base's contents (NaN/Inf) are checked only here, as they are read
            base = rebuild_base(
                ref.base, base_config(cfg.model, ref.base_dtype), mesh=mesh, rules=cfg.mesh.rules
            )
        except (ValueError, FileNotFoundError) as e:
            raise TrainingInputError(f"train.init_from_hf={cfg.train.init_from_hf}: {e}") from None
        if ref.base.init_from_hf is not None:
            log.info(f"initialised from {ref.base.init_from_hf}")
        if self.int8:
            return built.prepare_base(base)
        return jax.device_put(base, built.shardings["base"])


@dataclasses.dataclass(frozen=True)
class Built:
    graphdef: Any
    shardings: Params
    abstract: Params
    init: Callable[[int], Params]
    init_adapters: Callable[[int], Params] | None
    prepare_base: Callable[[Params], Params] | None
    init_model: Callable[[int], Params] | None = None  # a DPO reference mode's model alone
    reference_copy: Callable[[Params], Params] | None = None  # a copy of the model (the reference)

    def wrapped(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Built:
        """The same, each initialiser wrapped (step.py: run under the mesh's sharding rules)."""
        return dataclasses.replace(
            self,
            init=wrap(self.init),
            init_adapters=self.init_adapters and wrap(self.init_adapters),
            prepare_base=self.prepare_base and wrap(self.prepare_base),
            init_model=self.init_model and wrap(self.init_model),
            reference_copy=self.reference_copy and wrap(self.reference_copy),
        )


def forward_inputs(
    params: Params, lora_spec: lora.LoraSpec | None, dropout_key: jax.Array | None
) -> tuple[Params, tuple[lora.LoraSpec, lora.Adapters, jax.Array | None] | None]:
    """The model's own params and the forward's `adapters` argument (None: full fine-tuning)."""
    if lora_spec is None:
        return params, None
    return params["base"], (lora_spec, params["lora"], dropout_key)


def policy_and_reference(
    params: Params, lora_spec: lora.LoraSpec | None, dropout_key: jax.Array | None, with_reference: bool
) -> tuple[tuple[Params, Any], tuple[Params, Any] | None]:
    """(model params, adapters) of the policy and of the DPO reference (None: not needed): LoRA's
    reference is its base with the adapters off; full fine-tuning's the frozen copy "ref"."""
    if lora_spec is not None:
        return forward_inputs(params, lora_spec, dropout_key), (
            params["base"],
            None,
        ) if with_reference else None
    if isinstance(params, dict) and set(params) == {"model", "ref"}:
        return (params["model"], None), (params["ref"], None) if with_reference else None
    return (params, None), None


def _lora_shardings(spec: lora.LoraSpec, cfg: ModelConfig, mesh: Mesh, rules: shd.Rules) -> Params:
    """Adapters shard by the same logical-axis rules as the base (the rank axis is replicated)."""
    axes, shapes = lora.logical_axes(spec), lora.shapes(spec, cfg)
    return {
        name: {
            f: NamedSharding(mesh, shd.logical_to_spec(axes[name][f], rules, shapes[name][f], mesh))
            for f in ("a", "b")
        }
        for name in axes
    }
