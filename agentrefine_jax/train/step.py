"""The jitted train and eval steps, with explicit shardings (pjit).

Parameters travel as plain nested dicts (`nnx.to_pure_dict`), which `nnx.merge` turns
back into the module inside the traced function; this keeps optimizer state and
checkpoints free of framework objects.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrefine_jax import objective_table
from agentrefine_jax import sharding as shd
from agentrefine_jax.data.packing import BATCH_KEYS
from agentrefine_jax.models import Transformer, lora
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.objective_table import Objective
from agentrefine_jax.train import objectives
from agentrefine_jax.train.loss import resolve_loss_impl
from agentrefine_jax.train.param_mode import Built, ParamMode, policy_and_reference

Params = dict[str, Any]
Batch = dict[str, jax.Array]


@dataclasses.dataclass
class StepFns:
    graphdef: Any
    param_shardings: Params
    opt_shardings: Any
    # ShapeDtypeStruct trees of the pure-dict params and the optimizer state (restore targets).
    abstract_params: Params
    abstract_opt: Any
    batch_sharding: NamedSharding
    # The arrays a batch of this objective holds and their dtypes: data/packing.BATCH_KEYS (int32),
    # and the float32 ones its loss reads beside them (objectives.Loss.extra_keys; GRPO's).
    batch_dtypes: dict[str, Any]
    init_opt: Callable[[Params], Any]
    train: Callable[[Params, Any, Batch], tuple[Params, Any, dict[str, jax.Array]]]
    # The same step writing into `spare` (donated), not into the state it reads (kept): for the step
    # after a save on a CPU backend, whose input state Orbax is still reading (train_state.py).
    # Returns (trained params, opt_state, metrics); `train_into` puts the params back together.
    train_trained_into: Callable[[Params, Any, Batch, Any], tuple[Params, Any, dict[str, jax.Array]]]
    evaluate: Callable[[Params, Batch], tuple[jax.Array, jax.Array]]
    # Full / LoRA / int8 LoRA: what is held, trained, saved and merged (param_mode.py), and its
    # initialisers on this mesh (LoRA: params are {"base": frozen base, "lora": adapters}).
    mode: ParamMode
    built: Built

    @property
    def init_params(self) -> Callable[[int], Params]:
        """Seeded params of the whole mode (LoRA: a random base and fresh adapters)."""
        return self.built.init

    def trainable(self, params: Params) -> Params:
        """What the optimizer updates and a checkpoint stores: all params, or the adapters."""
        return self.mode.trainable(params)

    @property
    def abstract_trainable(self) -> Params:
        """The trained subset's shapes: a checkpoint's restore target (a reference copy or a LoRA
        base is rebuilt, never stored)."""
        return self.trainable(self.abstract_params)

    @property
    def trainable_shardings(self) -> Params:
        """The trained subset's shardings: where a restored checkpoint's arrays land."""
        return self.trainable(self.param_shardings)

    def train_into(
        self, params: Params, opt_state: Any, batch: Batch, spare: Any
    ) -> tuple[Params, Any, dict[str, jax.Array]]:
        """`train`, with the new (trained params, opt_state) written into the buffers of `spare`
        (a tree of that shape, donated) while `params` and `opt_state` stay as they were.
        `spare` None: plain `train` (see TrainCheckpoints.step_buffers, which says which)."""
        if spare is None:
            return self.train(params, opt_state, batch)
        trained, new_opt, metrics = self.train_trained_into(params, opt_state, batch, spare)
        return self.mode.with_trained(params, trained), new_opt, metrics

    def model(self, params: Params) -> Transformer:
        """The model these params describe, adapters merged into the base's weights."""
        return nnx.merge(self.graphdef, self.mode.merged(params))

    def handoff_model(self, params: Params, cfg: Any, mesh: Mesh) -> Transformer:
        """The model as the run hands it off: a LoRA run's adapters merged into its base as the
        user has it (param_mode.ParamMode.handoff); otherwise `model`."""
        return nnx.merge(self.graphdef, self.mode.handoff(params, cfg, mesh))


def objective_loss(
    graphdef: Any,
    params: Params,
    batch: Batch,
    objective: Objective,
    counts: Any,
    settings: objectives.Settings,
    lora_spec: lora.LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[Any, Any]:
    """A (micro) batch's (value, aux sums) of `objective`'s loss (train/objectives.py), `counts`
    the global batch's. The reference, when the entry has one (`objective.reference`: the entry as
    `build_steps` resolved it, its reference knob read): a LoRA run's base with the adapters off,
    a full run's frozen copy (params {"model", "ref"})."""
    policy, ref = policy_and_reference(params, lora_spec, dropout_key, objective.reference)

    def head(model_params: Params, adapters: Any, router_aux: bool = False) -> tuple[objectives.Head, Any]:
        model: Transformer = nnx.merge(graphdef, model_params)
        inputs = (batch["input_ids"], batch["positions"], batch["segment_ids"])
        if router_aux:
            hidden, aux = model.forward_with_router_loss(*inputs, adapters=adapters)
        else:
            (hidden, _), aux = model.forward(*inputs, adapters=adapters), None
        return (hidden[:, :-1], model.lm_head_weight()), aux

    loss = objectives.loss_of(objective)
    policy_head, router_aux = head(*policy, router_aux=bool(settings.router_aux_coef))
    ref_head = None if ref is None else head(*ref)[0]
    value, sums = loss.micro(policy_head, ref_head, batch, counts, settings)
    if router_aux is not None:
        # MoE load balancing (SFT only: config_checks): weighted by the micro batch's loss tokens,
        # so after the step's one division by the global count it is transformers'
        # `loss + router_aux_loss_coef * aux_loss` (exactly so for one micro batch).
        value = value + settings.router_aux_coef * router_aux * sums
    return value, sums


def loss_sums(
    graphdef: Any,
    params: Params,
    batch: Batch,
    chunk: int,
    impl: str = "remat",
    lora_spec: lora.LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
    router_aux_coef: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """(token loss sum, loss tokens) of `batch`: the default objective's (refinement tuning's)
    `objective_loss`, as the planner and the tests call it. With `router_aux_coef` (MoE models,
    `train.router_aux_loss`), coef x the batch's load-balancing loss joins the sum (see
    `objective_loss`)."""
    default = objective_table.get(objective_table.DEFAULT)
    settings = objectives.Settings(chunk=chunk, impl=impl, router_aux_coef=router_aux_coef)
    return objective_loss(graphdef, params, batch, default, (), settings, lora_spec, dropout_key)


def preference_loss(
    graphdef: Any,
    params: Params,
    batch: Batch,
    chunk: int,
    objective: str,
    counts: tuple[jax.Array, jax.Array],
    beta: float,
    sft_weight: float,
    dpo_weight: float,
    lora_spec: lora.LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A (micro) batch's share of a pair objective's loss, and its metric sums: `objective_loss`
    by name, `counts` the global batch's (SFT tokens, pairs)."""
    settings = objectives.Settings(chunk=chunk, beta=beta, sft_weight=sft_weight, dpo_weight=dpo_weight)
    spec = objective_table.get(objective)
    return objective_loss(graphdef, params, batch, spec, counts, settings, lora_spec, dropout_key)


def build_steps(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: shd.Rules,
    *,
    global_batch: int,
    micro_batch: int | None,
    loss_chunk: int,
    loss_impl: str = "auto",
    lora_spec: lora.LoraSpec | None = None,
    lora_base_dtype: str | None = None,
    mode: ParamMode | None = None,
    objective: str = objective_table.DEFAULT,
    knobs: dict[str, float] | None = None,
    router_aux_coef: float = 0.0,
) -> StepFns:
    """The jitted steps for `mode` (default: from model_cfg, lora_spec and lora_base_dtype) and
    `objective` (a name in the objective table; `knobs`: objectives.Settings' train.beta/sft_weight/
    dpo_weight and rl.clip_low/clip_high/kl_coef, whose reference knob decides whether the loss
    compares with the reference)."""
    if mode is None:  # the parameter mode decides from the settings (train/param_mode.py)
        mode = ParamMode.of_settings(model_cfg, lora_spec, lora_base_dtype)
    knobs = knobs or {}
    spec = objective_table.get(objective)
    # The entry as this run resolves it: with a reference, or not (a knob such as rl.kl_coef).
    reference = spec.holds_reference(knobs.get(spec.reference_field))
    spec = dataclasses.replace(spec, reference=reference, reference_knob="")
    mode = mode.for_objective(objective, reference)
    micro = micro_batch or global_batch
    if global_batch % micro:
        raise ValueError(f"train.global_batch_size={global_batch} not divisible by micro_batch_size={micro}")
    n_micro = global_batch // micro
    # Resolved against the mesh's devices (not the default backend): a TPU topology compiled from a
    # CPU host gets the TPU choice.
    loss_impl = resolve_loss_impl(loss_impl, mesh.devices.flat[0].platform)
    b_shard = shd.batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    built = mode.build(mesh, rules)
    graphdef, p_shard = built.graphdef, built.shardings
    with shd.use_sharding(mesh, rules):
        abstract_opt = jax.eval_shape(optimizer.init, mode.trainable(built.abstract))
    # Optimizer moments mirror the trained parameters' shardings; scalars (counts) are replicated.
    opt_shard = _mirror_shardings(abstract_opt, mode.trainable(p_shard), replicated)
    init_opt = jax.jit(
        lambda p: optimizer.init(mode.trainable(p)), in_shardings=(p_shard,), out_shardings=opt_shard
    )
    settings = objectives.Settings(chunk=loss_chunk, impl=loss_impl, router_aux_coef=router_aux_coef, **knobs)
    train_step, eval_step = _steps(mode, graphdef, optimizer, spec, settings, n_micro, micro)
    extra = objectives.loss_of(spec).extra_keys
    batch_dtypes = {**dict.fromkeys(BATCH_KEYS, jnp.int32), **dict.fromkeys(extra, jnp.float32)}
    batch_tree = {k: b_shard for k in batch_dtypes}
    train_jit = jax.jit(train_step, in_shardings=(p_shard, opt_shard, batch_tree),
                        out_shardings=(p_shard, opt_shard, replicated), donate_argnums=(0, 1))  # fmt: skip
    into_jit = _train_into_jit(train_step, mode, p_shard, opt_shard, batch_tree, replicated)
    eval_jit = jax.jit(eval_step, in_shardings=(p_shard, batch_tree), out_shardings=replicated)
    ruled = functools.partial(_with_rules, mesh, rules)
    return StepFns(
        graphdef=graphdef, param_shardings=p_shard, opt_shardings=opt_shard, abstract_params=built.abstract,
        abstract_opt=abstract_opt, batch_sharding=b_shard, batch_dtypes=batch_dtypes,
        init_opt=ruled(init_opt), train=ruled(train_jit), train_trained_into=ruled(into_jit),
        evaluate=ruled(eval_jit), mode=mode, built=built.wrapped(ruled),
    )  # fmt: skip


def _steps(
    mode: ParamMode,
    graphdef: Any,
    optimizer: optax.GradientTransformation,
    objective: Objective,
    settings: objectives.Settings,
    n_micro: int,
    micro: int,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The train and eval steps of `objective`: one body, the loss its table entry names."""
    loss = objectives.loss_of(objective)

    def loss_fn(params: Params, counts: Any) -> Callable[..., Any]:
        return mode.loss(
            objective_loss, graphdef, params, objective=objective, counts=counts, settings=settings
        )

    def train_step(params: Params, opt_state: Any, batch: Batch) -> tuple[Params, Any, dict[str, jax.Array]]:
        # The global counts first: a pair loss's micro batch adds its share of the global mean.
        counts = loss.counts(batch)
        micro_batches = {k: v.reshape(n_micro, micro, *v.shape[1:]) for k, v in batch.items()}
        trained = mode.trainable(params)
        grad_fn = jax.value_and_grad(loss_fn(params, counts), has_aux=True)
        keys = mode.dropout_keys(opt_state, n_micro)
        grads, value, aux = _accumulate(grad_fn, trained, micro_batches, keys, loss.aux_zeros(), loss.combine)
        done = loss.finish(value, aux, counts)
        _check_metrics(objective, done.metrics)

        def scaled(grads: Params) -> Params:  # sums: one division over the whole global batch
            return grads if done.scale is None else jax.tree.map(lambda g: g / done.scale, grads)

        # The norm of the sums, divided once: dividing every element inside the norm's reduction made
        # XLA:CPU materialise the scalar broadcast to each gradient's shape (SmolLM2: ~0.3 s a step).
        grad_norm = optax.global_norm(grads)
        if done.scale is not None:
            grad_norm = grad_norm / done.scale

        def update(args: tuple[Params, Any, Params]) -> tuple[Params, Any]:
            trained, opt_state, grads = args
            updates, new_opt = optimizer.update(scaled(grads), opt_state, trained)
            return optax.apply_updates(trained, updates), new_opt

        # Never apply an update from a batch with nothing to score or a non-finite loss:
        # the host stops the run on these, and the params in memory stay the last good ones.
        # A cond rather than a select per leaf: a select read every old moment beside its in-place
        # update, so XLA:CPU copied each moment first (1.1 GB per SmolLM2 step, 1.5x the update's time).
        ok = (done.guard > 0) & jnp.isfinite(done.loss) & jnp.isfinite(grad_norm)
        new_params, new_opt = jax.lax.cond(ok, update, lambda args: args[:2], (trained, opt_state, grads))
        tokens = jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)
        metrics = {
            "loss": done.loss,
            "loss_tokens": done.scored,
            "tokens": tokens,
            "projected_tokens": jnp.sum(loss.needed(batch)).astype(jnp.float32),
            "grad_norm": grad_norm,
        }
        return mode.with_trained(params, new_params), new_opt, {**metrics, **done.metrics}

    def eval_step(params: Params, batch: Batch) -> tuple[jax.Array, jax.Array]:
        counts = loss.counts(batch)
        value, aux = loss_fn(params, counts)(mode.trainable(params), batch, None)
        return loss.evaluation(value, aux, counts)

    return train_step, eval_step


def _check_metrics(objective: Objective, metrics: dict[str, jax.Array]) -> None:
    """The step logs what the objective's table entry says it logs (a trace-time check)."""
    if set(metrics) != set(objective.metrics):
        raise ValueError(
            f"objective {objective.name}: its loss logs {sorted(metrics)}, its table entry declares "
            f"{sorted(objective.metrics)}"
        )


def _train_into_jit(
    train_step: Callable[..., Any],
    mode: ParamMode,
    p_shard: Any,
    opt_shard: Any,
    batch_tree: Any,
    replicated: Any,
) -> Callable[..., Any]:
    """`train_step` taking a fourth argument, `spare` ((trained params, opt_state) of the same
    layout), donated so that the new state is written into its buffers, while the state it reads
    is kept (see StepFns.train_into). Returns the trained params alone: a LoRA base is read,
    never output, so it is not copied."""

    def step(params: Params, opt_state: Any, batch: Batch, spare: Any) -> tuple[Params, Any, Any]:
        del spare  # only donated: its buffers receive the outputs
        new_params, new_opt, metrics = train_step(params, opt_state, batch)
        return mode.trainable(new_params), new_opt, metrics

    trained = mode.trainable(p_shard)
    return jax.jit(
        step,
        in_shardings=(p_shard, opt_shard, batch_tree, (trained, opt_shard)),
        out_shardings=(trained, opt_shard, replicated),
        donate_argnums=(3,),
        keep_unused=True,  # `spare` is unused by the computation; donated all the same
    )


def _accumulate(
    grad_fn: Callable[..., Any],
    trained: Params,
    micro_batches: Batch,
    keys: jax.Array,
    aux_zeros: Any,
    combine: Callable[[Any, Any], Any],
) -> Any:
    """Sums over the micro batches of the gradients and the loss values, and their aux combined
    (`combine`: sums, a maximum) (a scan: one compiled body)."""

    def body(carry: tuple[Any, jax.Array, Any], xs: tuple[Batch, Any]) -> tuple[Any, None]:
        grads, value, aux = carry
        mb, key = xs
        mb = {k: shd.constrain(v, ("batch", None)) for k, v in mb.items()}
        (v, a), g = grad_fn(trained, mb, key)
        return (jax.tree.map(jnp.add, grads, g), value + v, combine(aux, a)), None

    init = (jax.tree.map(jnp.zeros_like, trained), jnp.zeros((), jnp.float32), aux_zeros)
    return jax.lax.scan(body, init, (micro_batches, keys))[0]


def _with_rules(mesh: Mesh, rules: shd.Rules, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run (and lower, for ahead-of-time compilation in train.aot) under the sharding rules."""

    def wrapped(*args: Any) -> Any:
        with shd.use_sharding(mesh, rules):
            return fn(*args)

    def lower(*args: Any) -> Any:
        with shd.use_sharding(mesh, rules):
            return fn.lower(*args)

    wrapped.lower = lower  # type: ignore[attr-defined]
    return wrapped


def _mirror_shardings(abstract_opt: Any, p_shard: Params, replicated: NamedSharding) -> Any:
    p_struct = jax.tree.structure(p_shard)

    def is_param_like(x: Any) -> bool:
        return isinstance(x, dict) and jax.tree.structure(x) == p_struct

    return jax.tree.map(
        lambda x: p_shard if is_param_like(x) else replicated, abstract_opt, is_leaf=is_param_like
    )
