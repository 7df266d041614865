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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from agentrefine_jax import sharding as shd
from agentrefine_jax.models import llama, lora, quant
from agentrefine_jax.models.config import ModelConfig

Params = dict[str, Any]
# A step's loss over the trained subset: (trained, micro batch, dropout key) -> ((loss sum, tokens), ...)
LossFn = Callable[[Params, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class ParamMode:
    model_cfg: ModelConfig  # the stored model (a LoRA base in its own dtype)
    merged_dtype: str  # model.param_dtype: what a merged LoRA model is cast to
    lora_spec: lora.LoraSpec | None = None
    int8: bool = False

    @classmethod
    def of(cls, model_cfg: ModelConfig, lora_spec: lora.LoraSpec | None, base_dtype: str | None) -> ParamMode:
        merged = model_cfg.param_dtype
        if lora_spec is not None and base_dtype:  # the frozen base is stored in its own dtype
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
        """Jitted initialisers, shardings and abstract shapes on `mesh`."""
        graphdef, abs_state = llama.abstract_params(self.model_cfg)
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
        if self.lora_spec is not None:
            a_shard = _lora_shardings(self.lora_spec, self.model_cfg, mesh, rules)
            init_adapters = jax.jit(self.init_adapters, static_argnums=0, out_shardings=a_shard)
            base_init = init
            init = lambda seed: {"base": base_init(seed), "lora": init_adapters(seed)}  # noqa: E731
            shardings = {"base": base_shard, "lora": a_shard}
            with shd.use_sharding(mesh, rules):
                abstract = {"base": abstract, "lora": jax.eval_shape(lambda: self.init_adapters(0))}
        return Built(graphdef, shardings, abstract, init, init_adapters, prepare_base)

    # ------------------------------------------------------------------ training

    def trainable(self, tree: Any) -> Any:
        """What the optimizer updates and a checkpoint stores: all params, or the adapters."""
        return tree["lora"] if self.lora_spec is not None else tree

    def with_trained(self, params: Params, trained: Params) -> Params:
        return {"base": params["base"], "lora": trained} if self.lora_spec is not None else trained

    def loss(self, loss_sums: Callable[..., Any], graphdef: Any, params: Params, **kw: Any) -> LossFn:
        """The loss over the trained subset (the base, if any, enters as a constant)."""
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
        if self.lora_spec is None:
            return params
        return lora.merge(params["base"], params["lora"], self.lora_spec, self.merged_dtype)


@dataclasses.dataclass(frozen=True)
class Built:
    graphdef: Any
    shardings: Params
    abstract: Params
    init: Callable[[int], Params]
    init_adapters: Callable[[int], Params] | None
    prepare_base: Callable[[Params], Params] | None


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
