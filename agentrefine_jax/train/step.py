"""The jitted train and eval steps, with explicit shardings (pjit).

Parameters travel as plain nested dicts (`nnx.to_pure_dict`), which `nnx.merge` turns
back into the module inside the traced function; this keeps optimizer state and
checkpoints free of framework objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrefine_jax import sharding as shd
from agentrefine_jax.checkpoint import abstract_params, param_shardings
from agentrefine_jax.data.packing import BATCH_KEYS
from agentrefine_jax.models import Transformer, lora, quant
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.train.loss import chunked_cross_entropy, resolve_loss_impl, target_weights

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
    init_params: Callable[[int], Params]
    init_opt: Callable[[Params], Any]
    train: Callable[[Params, Any, Batch], tuple[Params, Any, dict[str, jax.Array]]]
    evaluate: Callable[[Params, Batch], tuple[jax.Array, jax.Array]]
    # LoRA: params are {"base": frozen model params, "lora": adapters}; only the adapters are
    # differentiated, held in the optimizer state and checkpointed (`trainable`).
    lora_spec: lora.LoraSpec | None = None
    init_adapters: Callable[[int], Params] | None = None
    merged_dtype: str | None = None  # model.param_dtype: what a merged LoRA model is cast to
    # int8 base: a bfloat16 base's params (HF import) -> the stored, quantised base; else None.
    prepare_base: Callable[[Params], Params] | None = None

    def trainable(self, params: Params) -> Params:
        """What the optimizer updates and a checkpoint stores: all params, or the adapters."""
        return params["lora"] if self.lora_spec else params

    @property
    def abstract_trainable(self) -> Params:
        return self.trainable(self.abstract_params)

    @property
    def trainable_shardings(self) -> Params:
        return self.trainable(self.param_shardings)

    def model(self, params: Params) -> Transformer:
        """The model these params describe, adapters merged into the base's weights."""
        if self.lora_spec:
            params = lora.merge(params["base"], params["lora"], self.lora_spec, self.merged_dtype)
        return nnx.merge(self.graphdef, params)


def loss_sums(
    graphdef: Any,
    params: Params,
    batch: Batch,
    chunk: int,
    impl: str = "remat",
    lora_spec: lora.LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    adapters = None
    if lora_spec is not None:
        adapters = (lora_spec, params["lora"], dropout_key)
        params = params["base"]
    model: Transformer = nnx.merge(graphdef, params)
    hidden, _ = model.forward(batch["input_ids"], batch["positions"], batch["segment_ids"], adapters=adapters)
    targets, weights = target_weights(batch)
    return chunked_cross_entropy(hidden[:, :-1], model.lm_head_weight(), targets, weights, chunk, impl)


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
) -> StepFns:
    merged_dtype = model_cfg.param_dtype
    int8_base = lora_spec is not None and lora_base_dtype == "int8"
    if lora_spec is not None and lora_base_dtype:  # the frozen base is stored in its own dtype
        model_cfg = dataclasses.replace(model_cfg, param_dtype=quant.storage_dtype(lora_base_dtype))
    graphdef, abs_state = abstract_params(model_cfg)
    p_shard = param_shardings(abs_state, mesh, rules)
    micro = micro_batch or global_batch
    if global_batch % micro:
        raise ValueError(f"train.global_batch_size={global_batch} not divisible by micro_batch_size={micro}")
    n_micro = global_batch // micro
    # Resolved against the mesh's devices (not the default backend): a TPU topology compiled from a
    # CPU host gets the TPU choice.
    loss_impl = resolve_loss_impl(loss_impl, mesh.devices.flat[0].platform)
    b_shard = shd.batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())

    def init_params(seed: int) -> Params:
        from agentrefine_jax.models import create

        return nnx.to_pure_dict(nnx.state(create(model_cfg, seed), nnx.Param))

    init_params_jit = jax.jit(init_params, static_argnums=0, out_shardings=p_shard)
    init_adapters_jit = prepare_base = None
    if int8_base:  # QLoRA-style: the projections held as int8 + per-channel scales (models/quant.py)
        # A separate jit on the materialised bfloat16 base: the HF-import path and checkpoint.load_lora
        # quantise the same arrays the same way.
        prepare_base = jax.jit(quant.quantize_base, out_shardings=quant.shardings(p_shard))
        bf16_init = init_params_jit
        init_params_jit = lambda seed: prepare_base(bf16_init(seed))  # noqa: E731
        p_shard = quant.shardings(p_shard)
    if lora_spec is not None:
        a_shard = _lora_shardings(lora_spec, model_cfg, mesh, rules)

        def init_adapters(seed: int) -> Params:
            # Its own stream: the base drawn from `seed` is the same with or without LoRA.
            return lora.init(lora_spec, model_cfg, jax.random.fold_in(jax.random.key(seed), 0x10A))

        init_adapters_jit = jax.jit(init_adapters, static_argnums=0, out_shardings=a_shard)
        base_init = init_params_jit
        init_params_jit = lambda seed: {"base": base_init(seed), "lora": init_adapters_jit(seed)}  # noqa: E731
        p_shard = {"base": p_shard, "lora": a_shard}
    with shd.use_sharding(mesh, rules):
        abstract_pure = jax.eval_shape(lambda: init_params(0))
        if int8_base:
            abstract_pure = jax.eval_shape(quant.quantize_base, abstract_pure)
        if lora_spec is not None:
            abstract_pure = {"base": abstract_pure, "lora": jax.eval_shape(lambda: init_adapters(0))}
        abstract_opt = jax.eval_shape(optimizer.init, _trainable(abstract_pure, lora_spec))
    t_shard = _trainable(p_shard, lora_spec)
    # Optimizer moments mirror the trained parameters' shardings; scalars (counts) are replicated.
    opt_shard = _mirror_shardings(abstract_opt, t_shard, replicated)
    init_opt = jax.jit(
        lambda p: optimizer.init(_trainable(p, lora_spec)), in_shardings=(p_shard,), out_shardings=opt_shard
    )

    def train_step(params: Params, opt_state: Any, batch: Batch) -> tuple[Params, Any, dict[str, jax.Array]]:
        micro_batches = {k: v.reshape(n_micro, micro, *v.shape[1:]) for k, v in batch.items()}
        trained = _trainable(params, lora_spec)
        if lora_spec is None:
            grad_fn = jax.value_and_grad(
                lambda p, mb, key: loss_sums(graphdef, p, mb, loss_chunk, loss_impl), has_aux=True
            )
            keys = jnp.zeros((n_micro,), jnp.uint32)
        else:  # the base enters as a constant: never differentiated, never in the optimizer
            grad_fn = jax.value_and_grad(
                lambda a, mb, key: loss_sums(
                    graphdef, {"base": params["base"], "lora": a}, mb, loss_chunk, loss_impl, lora_spec, key
                ),
                has_aux=True,
            )
            # Dropout masks from the optimizer's update count: a resumed run draws the same ones.
            count = optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]
            keys = jax.random.split(jax.random.fold_in(jax.random.key(0x10A), count), n_micro)

        def accumulate(carry: tuple[Any, jax.Array, jax.Array], xs: tuple[Batch, Any]) -> tuple[Any, None]:
            grads, loss_sum, n_tok = carry
            mb, key = xs
            mb = {k: shd.constrain(v, ("batch", None)) for k, v in mb.items()}
            (l_sum, n), g = grad_fn(trained, mb, key)
            grads = jax.tree.map(jnp.add, grads, g)
            return (grads, loss_sum + l_sum, n_tok + n), None

        zeros = jax.tree.map(jnp.zeros_like, trained)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, loss_sum, n_tok), _ = jax.lax.scan(accumulate, init, (micro_batches, keys))
        # One division over the whole global batch: every loss token weighs the same.
        denom = jnp.maximum(n_tok, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = loss_sum / denom
        grad_norm = optax.global_norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, trained)
        new_params = optax.apply_updates(trained, updates)
        # Never apply an update from a batch with no loss tokens or a non-finite loss:
        # the host stops the run on these, and the params in memory stay the last good ones.
        ok = (n_tok > 0) & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_params = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_params, trained)
        new_opt = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_opt, opt_state)
        if lora_spec is not None:
            new_params = {"base": params["base"], "lora": new_params}
        metrics = {
            "loss": loss,
            "loss_tokens": n_tok,
            "tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
            "grad_norm": grad_norm,
        }
        return new_params, new_opt, metrics

    def eval_step(params: Params, batch: Batch) -> tuple[jax.Array, jax.Array]:
        return loss_sums(graphdef, params, batch, loss_chunk, loss_impl, lora_spec)

    batch_tree = {k: b_shard for k in BATCH_KEYS}
    train_jit = jax.jit(
        train_step,
        in_shardings=(p_shard, opt_shard, batch_tree),
        out_shardings=(p_shard, opt_shard, replicated),
        donate_argnums=(0, 1),
    )
    eval_jit = jax.jit(eval_step, in_shardings=(p_shard, batch_tree), out_shardings=replicated)

    def with_rules(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            with shd.use_sharding(mesh, rules):
                return fn(*args)

        def lower(*args: Any) -> Any:  # ahead-of-time compilation (train.aot) traces the same way
            with shd.use_sharding(mesh, rules):
                return fn.lower(*args)

        wrapped.lower = lower  # type: ignore[attr-defined]
        return wrapped

    return StepFns(
        graphdef=graphdef,
        param_shardings=p_shard,
        opt_shardings=opt_shard,
        abstract_params=abstract_pure,
        abstract_opt=abstract_opt,
        batch_sharding=b_shard,
        init_params=with_rules(init_params_jit),
        init_opt=with_rules(init_opt),
        train=with_rules(train_jit),
        evaluate=with_rules(eval_jit),
        lora_spec=lora_spec,
        init_adapters=None if init_adapters_jit is None else with_rules(init_adapters_jit),
        merged_dtype=merged_dtype,
        prepare_base=None if prepare_base is None else with_rules(prepare_base),
    )


def _trainable(tree: Any, lora_spec: lora.LoraSpec | None) -> Any:
    return tree["lora"] if lora_spec is not None else tree


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


def _mirror_shardings(abstract_opt: Any, p_shard: Params, replicated: NamedSharding) -> Any:
    p_struct = jax.tree.structure(p_shard)

    def is_param_like(x: Any) -> bool:
        return isinstance(x, dict) and jax.tree.structure(x) == p_struct

    return jax.tree.map(
        lambda x: p_shard if is_param_like(x) else replicated, abstract_opt, is_leaf=is_param_like
    )
