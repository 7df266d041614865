"""The objectives' losses, as the one train step (step.py) runs them: the SFT token loss, and
DPO / ORPO / SFT + DPO over packed pair rows. Each objective is declared once, in the objective
table (agentrefine_jax/objective_table.py), whose entry names its `Loss` here (`loss_of`).

A `Loss` answers the step's four questions: the global batch's counts (taken before the batch is
cut into micro batches), a micro batch's (value, aux sums) from the policy's — and, when the
entry has one, the reference's — hidden states, what the summed values finish into (the loss,
what the gradients divide by, the count an update needs, the logged metrics), and an
evaluation batch's (sum, weight).

A batch row holds packing units (data/pipeline.py): SFT examples (loss_mask 1 on their trained
tokens) and pairs, a pair being two consecutive segments s (chosen, loss_mask CHOSEN on its
reply) and s+1 (rejected, loss_mask REJECTED). A sequence's log-probability is the sum of its
reply tokens' log-probabilities, found per segment with one segment sum per row.

Formulas (TRL's documented ones; tests/test_train_preference.py checks them against an
independent PyTorch implementation):
- SFT: the refinement-masked token NLL (loss.py): sums per micro batch, one division by the
  global batch's loss tokens.
- DPO (sigmoid): h = (pi_c - pi_r) - (ref_c - ref_r); loss = -log sigmoid(beta * h);
  rewards chosen/rejected = beta * (pi - ref) of each reply.
- ORPO: with p = the mean token log-probability of each reply, log odds = (p_c - p_r) -
  (log(1 - e^p_c) - log(1 - e^p_r)); loss = NLL_c - beta * log sigmoid(log odds), NLL_c the mean
  token NLL of the chosen reply; rewards = beta * p. (TRL averages the NLL over the chosen tokens
  of the whole batch; here each pair's own mean, so a pair weighs the same whatever its length.)
- SFT + DPO: sft_weight * (SFT token loss sum / SFT tokens) + dpo_weight * (DPO loss sum / pairs).
- GRPO (PolicyGradient; a batch of rollouts, rl/batch.py): over the global batch's trainable
  (sampled) target tokens t, N of them, with r_t = exp(logp_t - old_t) and A_t its episode's
  advantage, loss = -(1/N) sum_t min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
  + kl_coef (1/N) sum_t k3_t, k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (the k3 estimator
  of KL(policy || reference); the term only while the reference is on). Token-level aggregation:
  every sampled token of the step weighs the same, whichever episode it is in (DAPO's, not
  GRPO's original per-episode mean). Both exponents are clamped to [-20, 20] (as verl does), so
  that a token far off its sampling log-probability gives a huge but finite ratio, never an
  inf (and a NaN gradient).
Every pair (token) mean is over the global batch: a micro batch's value is its share of it (the
global counts given), so micro batches and devices add (never a mean of means).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from agentrefine_jax.data.preference import CHOSEN, REJECTED
from agentrefine_jax.objective_table import Objective
from agentrefine_jax.train.loss import (
    TokenLayout,
    chunk_logits_lse,
    chunked_cross_entropy,
    target_logit,
    target_weights,
)

Batch = dict[str, jax.Array]
# A model's output for the loss: (the hidden state before each target [B, T-1, D], lm_head [D, V]).
Head = tuple[jax.Array, jax.Array]
METRICS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")
# GRPO's exponents (log ratios) are clamped to +-this: exp(20) ~ 4.9e8 is finite in float32.
MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a loss reads beside the batch: the vocabulary chunk, the token loss's implementation
    (loss.py), and the train.* knobs (beta: DPO's beta, ORPO's lambda; the terms' weights)."""

    chunk: int
    impl: str = "remat"
    beta: float = 0.1
    sft_weight: float = 1.0
    dpo_weight: float = 1.0
    router_aux_coef: float = 0.0  # MoE load-balancing loss weight (train.router_aux_loss), SFT only
    clip_low: float = 0.2  # GRPO: the ratio is clipped to [1 - clip_low, 1 + clip_high] (rl.*)
    clip_high: float = 0.28
    kl_coef: float = 0.0  # GRPO: the k3 KL term's weight (rl.kl_coef; > 0 switches the reference on)


@dataclasses.dataclass(frozen=True)
class Finished:
    """A global batch's summed micro-batch values, finished."""

    loss: jax.Array
    scale: jax.Array | None  # the summed gradients divide by this (None: the values were shares)
    scored: jax.Array  # what the loss averages over (logged as loss_tokens: tokens, pairs, or both)
    guard: jax.Array  # the update is applied only when this count is > 0 (and all is finite)
    metrics: dict[str, jax.Array]  # logged beside loss, loss_tokens, tokens, grad_norm


class Loss(abc.ABC):
    """An objective's loss (see the module docstring); `loss_of` finds an entry's."""

    # The float32 [rows, T] arrays its batch carries beside data/packing.BATCH_KEYS (int32).
    extra_keys: tuple[str, ...] = ()

    @abc.abstractmethod
    def needed(self, batch: Batch) -> jax.Array:
        """[B, T-1] bool: the targets whose log-probabilities the loss reads — the only positions
        that reach the vocabulary projection (loss.TokenLayout); their count is logged
        (`projected_tokens`) and is what a step's FLOPs count for the output layer."""

    def combine(self, a: Any, b: Any) -> Any:
        """Two micro batches' aux, combined (sums add; a loss with a maximum overrides this)."""
        return jax.tree.map(jnp.add, a, b)

    @abc.abstractmethod
    def counts(self, batch: Batch) -> Any:
        """The global batch's counts a micro batch's value needs (before the batch is cut)."""

    @abc.abstractmethod
    def aux_zeros(self) -> Any:
        """Zeros shaped like `micro`'s aux: the micro-batch sum starts from them."""

    @abc.abstractmethod
    def micro(
        self, policy: Head, ref: Head | None, batch: Batch, counts: Any, s: Settings
    ) -> tuple[Any, Any]:
        """A micro batch's (value, aux sums): values and aux add up over the micro batches."""

    @abc.abstractmethod
    def finish(self, value: jax.Array, aux: Any, counts: Any) -> Finished:
        """The global batch's summed values and aux, finished."""

    @abc.abstractmethod
    def evaluation(self, value: jax.Array, aux: Any, counts: Any) -> tuple[jax.Array, jax.Array]:
        """(sum, weight) of an evaluation batch: the split's loss is sum / weight over its batches."""


def token_logps(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, chunk: int, needed: jax.Array | None = None
) -> jax.Array:
    """log p(target) per position, [B, T] float32, where `needed` ([B, T] bool; None: everywhere)
    is set and 0 elsewhere: only needed positions reach the vocabulary projection
    (loss.TokenLayout), chunk by chunk, each chunk rematerialised in the backward pass (no
    [B, T, V] logits live)."""
    return _token_stats(hidden, lm_head, targets, chunk, needed, entropy=False)[0]


def token_logps_entropy(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, chunk: int, needed: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """`token_logps` and the policy's entropy per needed position (both [B, T] float32, 0 elsewhere),
    from the same chunks' logits. The entropy is a metric: no gradient flows from it."""
    return _token_stats(hidden, lm_head, targets, chunk, needed, entropy=True)


def _token_stats(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    chunk: int,
    needed: jax.Array | None,
    entropy: bool,
) -> tuple[jax.Array, jax.Array | None]:
    needed = jnp.ones(targets.shape, bool) if needed is None else needed
    lay = TokenLayout.of(needed.astype(jnp.float32), chunk)
    hs, ts = lay.split(hidden), lay.split(targets)
    w = lm_head.astype(hidden.dtype)

    def one(h: jax.Array, tgt: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, lse = chunk_logits_lse(h, w)
        logp = target_logit(logits, tgt) - lse
        if not entropy:
            return logp, jnp.zeros_like(logp)
        # H = lse - sum_v p_v logit_v, on constants (a metric: nothing to differentiate).
        lg, ls = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
        return logp, ls - jnp.sum(jnp.exp(lg - ls[..., None]) * lg, axis=-1)

    def idle(h: jax.Array, tgt: jax.Array) -> tuple[jax.Array, jax.Array]:
        zero = jnp.zeros(tgt.shape, jnp.float32)
        return zero, zero

    # The checkpoint outside the cond (see loss._chunked_loss): lm_head stays one residual.
    @jax.checkpoint
    def maybe(k: jax.Array, h: jax.Array, tgt: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.lax.cond(k < lay.live, one, idle, h, tgt)

    steps = jnp.arange(hs.shape[0])
    logp, ent = jax.lax.map(lambda xs: maybe(*xs), (steps, hs, ts))  # [n, G, chunk] each
    shape = targets.shape
    return lay.merge(logp, shape), lay.merge(ent, shape) if entropy else None


def _target_kinds(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(loss_mask value of each target, its segment), [B, T-1]; 0 where nothing is scored."""
    mask, seg = batch["loss_mask"], batch["segment_ids"]
    same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return jnp.where(same_doc, mask[:, 1:], 0), seg[:, 1:]


def _per_segment(values: jax.Array, seg: jax.Array) -> jax.Array:
    """Sum of `values` per (row, segment id): [B, T+1] (segment ids are < T+1)."""
    b, t = values.shape
    ids = (jnp.arange(b)[:, None] * (t + 1) + seg).reshape(-1)
    return jax.ops.segment_sum(values.reshape(-1), ids, num_segments=b * (t + 1)).reshape(b, t + 1)


def pair_logps(logp: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per pair slot [B, T]: chosen / rejected log-prob sums and token counts, and `valid`
    (a pair starts at this segment)."""
    kind, seg = _target_kinds(batch)
    c, r = (kind == CHOSEN).astype(jnp.float32), (kind == REJECTED).astype(jnp.float32)
    c_sum, r_sum = _per_segment(logp * c, seg), _per_segment(logp * r, seg)
    c_n, r_n = _per_segment(c, seg), _per_segment(r, seg)
    # Chosen at segment s, its rejected at s + 1.
    return {
        "chosen": c_sum[:, :-1],
        "rejected": r_sum[:, 1:],
        "chosen_n": c_n[:, :-1],
        "rejected_n": r_n[:, 1:],
        "valid": (c_n[:, :-1] > 0).astype(jnp.float32),
    }


def count_pairs(batch: dict[str, jax.Array]) -> jax.Array:
    """Pairs in the batch: segments holding a chosen reply's targets."""
    kind, seg = _target_kinds(batch)
    return jnp.sum(_per_segment((kind == CHOSEN).astype(jnp.float32), seg) > 0).astype(jnp.float32)


def count_sft_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.sum(_target_kinds(batch)[0] == 1).astype(jnp.float32)


def dpo_terms(
    pi: dict[str, jax.Array], ref: dict[str, jax.Array] | None, beta: float
) -> dict[str, jax.Array]:
    """Per slot: loss and rewards of sigmoid DPO (invalid slots are the caller's to mask)."""
    if ref is None:
        raise ValueError("DPO compares with a reference: its objective table entry must say reference=True")
    logits = (pi["chosen"] - pi["rejected"]) - (ref["chosen"] - ref["rejected"])
    return {
        "loss": -jax.nn.log_sigmoid(beta * logits),
        "rewards_chosen": beta * jax.lax.stop_gradient(pi["chosen"] - ref["chosen"]),
        "rewards_rejected": beta * jax.lax.stop_gradient(pi["rejected"] - ref["rejected"]),
    }


def orpo_terms(
    pi: dict[str, jax.Array], ref: dict[str, jax.Array] | None, beta: float
) -> dict[str, jax.Array]:
    """Per slot: loss and rewards of ORPO (no reference: `ref` is unused)."""
    del ref
    pc = pi["chosen"] / jnp.maximum(pi["chosen_n"], 1.0)
    pr = pi["rejected"] / jnp.maximum(pi["rejected_n"], 1.0)
    # log(1 - e^p) for p < 0, stable: log(-expm1(p)); clamp keeps p == 0 (an empty reply) finite.
    pc_, pr_ = jnp.minimum(pc, -1e-6), jnp.minimum(pr, -1e-6)
    log_odds = (pc - pr) - (jnp.log(-jnp.expm1(pc_)) - jnp.log(-jnp.expm1(pr_)))
    return {
        "loss": -pc - beta * jax.nn.log_sigmoid(log_odds),
        "rewards_chosen": beta * jax.lax.stop_gradient(pc),
        "rewards_rejected": beta * jax.lax.stop_gradient(pr),
    }


def finish_metrics(aux: dict[str, Any], n_pairs: jax.Array, n_tokens: jax.Array) -> dict[str, jax.Array]:
    """Sums over the global batch -> the logged means."""
    p = jnp.maximum(n_pairs, 1.0)
    out = {k: aux[k] / p for k in METRICS}
    out["pair_loss"] = aux["pair_loss"] / p
    out["pairs"] = n_pairs
    out["sft_loss"] = aux["sft_loss"] / jnp.maximum(n_tokens, 1.0)
    return out


class TokenNll(Loss):
    """SFT: the refinement-masked token NLL; a micro batch adds (loss sum, loss tokens), and the
    step divides once by the global batch's tokens (every loss token weighs the same)."""

    def needed(self, batch: Batch) -> jax.Array:
        return target_weights(batch)[1] > 0

    def counts(self, batch: Batch) -> tuple[()]:
        return ()

    def aux_zeros(self) -> jax.Array:
        return jnp.zeros((), jnp.float32)

    def micro(
        self, policy: Head, ref: Head | None, batch: Batch, counts: Any, s: Settings
    ) -> tuple[Any, Any]:
        targets, weights = target_weights(batch)
        return chunked_cross_entropy(*policy, targets, weights, s.chunk, s.impl)

    def finish(self, value: jax.Array, aux: jax.Array, counts: Any) -> Finished:
        denom = jnp.maximum(aux, 1.0)
        return Finished(loss=value / denom, scale=denom, scored=aux, guard=aux, metrics={})

    def evaluation(self, value: jax.Array, aux: jax.Array, counts: Any) -> tuple[jax.Array, jax.Array]:
        return value, aux


@dataclasses.dataclass(frozen=True)
class PairLoss(Loss):
    """A pair loss (`terms`: DPO's or ORPO's), with the SFT token loss beside it (`with_sft`:
    sft_weight x SFT + dpo_weight x pairs). A micro batch's value is its share of the global
    batch's mean (counts: the global (SFT tokens, pairs)); its aux, the metrics' sums."""

    terms: Callable[[dict[str, jax.Array], dict[str, jax.Array] | None, float], dict[str, jax.Array]]
    with_sft: bool = False

    def counts(self, batch: Batch) -> tuple[jax.Array, jax.Array]:
        return count_sft_tokens(batch), count_pairs(batch)

    def needed(self, batch: Batch) -> jax.Array:
        kind, _ = _target_kinds(batch)
        paired = (kind == CHOSEN) | (kind == REJECTED)
        return paired | (kind == 1) if self.with_sft else paired

    def aux_zeros(self) -> dict[str, jax.Array]:
        zero = jnp.zeros((), jnp.float32)
        return {k: zero for k in (*METRICS, "pair_loss", "sft_loss")}

    def micro(
        self, policy: Head, ref: Head | None, batch: Batch, counts: Any, s: Settings
    ) -> tuple[Any, Any]:
        targets = batch["input_ids"][:, 1:]
        needed = self.needed(batch)
        logp = token_logps(*policy, targets, s.chunk, needed)
        ref_logp = None if ref is None else token_logps(*ref, targets, s.chunk, needed)
        n_tokens, n_pairs = counts
        pi = pair_logps(logp, batch)
        ref_pairs = None if ref_logp is None else pair_logps(jax.lax.stop_gradient(ref_logp), batch)
        terms = self.terms(pi, ref_pairs, s.beta)
        valid = pi["valid"]
        pair_loss = jnp.sum(terms["loss"] * valid)
        weight = s.dpo_weight if self.with_sft else 1.0
        loss = weight * pair_loss / jnp.maximum(n_pairs, 1.0)
        aux = {
            "pair_loss": pair_loss,
            "rewards_chosen": jnp.sum(terms["rewards_chosen"] * valid),
            "rewards_rejected": jnp.sum(terms["rewards_rejected"] * valid),
            "margin": jnp.sum((terms["rewards_chosen"] - terms["rewards_rejected"]) * valid),
            "accuracy": jnp.sum((terms["rewards_chosen"] > terms["rewards_rejected"]) * valid),
            "sft_loss": jnp.zeros((), jnp.float32),
        }
        if self.with_sft:
            kind, _ = _target_kinds(batch)
            sft_sum = -jnp.sum(jnp.where(kind == 1, logp, 0.0))
            loss = loss + s.sft_weight * sft_sum / jnp.maximum(n_tokens, 1.0)
            aux["sft_loss"] = jax.lax.stop_gradient(sft_sum)
        return loss, aux

    def finish(self, value: jax.Array, aux: dict[str, jax.Array], counts: Any) -> Finished:
        n_tokens, n_pairs = counts
        scored = n_pairs + n_tokens if self.with_sft else n_pairs
        metrics = finish_metrics(aux, n_pairs, n_tokens)
        return Finished(loss=value, scale=None, scored=scored, guard=n_pairs, metrics=metrics)

    def evaluation(self, value: jax.Array, aux: Any, counts: Any) -> tuple[jax.Array, jax.Array]:
        """(the batch's loss x its pairs, pairs): the evaluation's mean is over pairs."""
        return value * counts[1], counts[1]


class PolicyGradient(Loss):
    """GRPO's clipped policy-gradient loss over a batch of rollouts (rl/batch.py's arrays; the
    formula in the module docstring). Target t (token t, predicted from the tokens before it) is
    trained where loss_mask[t] is set within its episode's segment, with old_logprobs[t] and
    advantages[t]; every other token (prompt, environment, template, padding) carries nothing:
    its log-probability, old log-probability and advantage enter no sum. counts: the global
    batch's trainable tokens (N) and its advantages' mean and std over them; a micro batch's value
    is its share of the global token mean, its aux the metrics' sums (and the maximum |logp - old|).

    clip_fraction counts the tokens whose clipped term is the minimum and flat (r < 1 - clip_low
    with A < 0, or r > 1 + clip_high with A > 0): the tokens clipping takes out of the gradient."""

    extra_keys = ("old_logprobs", "advantages")
    SUMS = ("clipped", "kl", "entropy", "ratio")

    def needed(self, batch: Batch) -> jax.Array:
        return target_weights(batch)[1] > 0

    def counts(self, batch: Batch) -> dict[str, jax.Array]:
        _, w = target_weights(batch)
        adv = batch["advantages"][:, 1:].astype(jnp.float32)
        n = jnp.sum(w)
        mean = jnp.sum(adv * w) / jnp.maximum(n, 1.0)
        var = jnp.sum(jnp.square(adv - mean) * w) / jnp.maximum(n, 1.0)
        return {"tokens": n, "advantage_mean": mean, "advantage_std": jnp.sqrt(var)}

    def aux_zeros(self) -> dict[str, jax.Array]:
        zero = jnp.zeros((), jnp.float32)  # |logp - old| >= 0: zero is also the maximum's identity
        return {k: zero for k in (*self.SUMS, "max_abs_logp_delta")}

    def combine(self, a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {k: a[k] + b[k] for k in self.SUMS}
        out["max_abs_logp_delta"] = jnp.maximum(a["max_abs_logp_delta"], b["max_abs_logp_delta"])
        return out

    def micro(
        self, policy: Head, ref: Head | None, batch: Batch, counts: Any, s: Settings
    ) -> tuple[Any, Any]:
        targets, _ = target_weights(batch)
        on = self.needed(batch)
        logp, entropy = token_logps_entropy(*policy, targets, s.chunk, on)
        old = batch["old_logprobs"][:, 1:].astype(jnp.float32)
        adv = batch["advantages"][:, 1:].astype(jnp.float32)
        # Off the trained tokens, delta is 0 (ratio 1) and every term below is masked out: neither
        # their values nor their gradients reach the loss.
        delta = jnp.where(on, logp - old, 0.0)
        ratio = jnp.exp(jnp.clip(delta, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        lo, hi = 1.0 - s.clip_low, 1.0 + s.clip_high
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
        n = jnp.maximum(counts["tokens"], 1.0)
        value = -jnp.sum(jnp.where(on, surrogate, 0.0)) / n
        kl_sum = jnp.zeros((), jnp.float32)
        if ref is not None:
            d = jnp.where(on, jax.lax.stop_gradient(token_logps(*ref, targets, s.chunk, on)) - logp, 0.0)
            d = jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
            kl_sum = jnp.sum(jnp.where(on, jnp.exp(d) - d - 1.0, 0.0))
            value = value + s.kl_coef * kl_sum / n
        sg = jax.lax.stop_gradient
        clipped = on & (((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0)))
        aux = {
            "clipped": jnp.sum(clipped).astype(jnp.float32),
            "kl": sg(kl_sum),
            "entropy": jnp.sum(jnp.where(on, entropy, 0.0)),
            "ratio": sg(jnp.sum(jnp.where(on, ratio, 0.0))),
            "max_abs_logp_delta": sg(jnp.max(jnp.abs(delta), initial=0.0)),
        }
        return value, aux

    def finish(self, value: jax.Array, aux: dict[str, jax.Array], counts: Any) -> Finished:
        n = counts["tokens"]
        d = jnp.maximum(n, 1.0)
        metrics = {
            "clip_fraction": aux["clipped"] / d,
            "kl": aux["kl"] / d,
            "entropy": aux["entropy"] / d,
            "ratio_mean": aux["ratio"] / d,
            "advantage_mean": counts["advantage_mean"],
            "advantage_std": counts["advantage_std"],
            "max_abs_logp_delta": aux["max_abs_logp_delta"],
        }
        return Finished(loss=value, scale=None, scored=n, guard=n, metrics=metrics)

    def evaluation(self, value: jax.Array, aux: Any, counts: Any) -> tuple[jax.Array, jax.Array]:
        """(the batch's loss x its trainable tokens, tokens): the evaluation's mean is per token."""
        return value * counts["tokens"], counts["tokens"]


# The losses the objective table's entries name (objective_table.Objective.loss).
TOKEN_NLL = TokenNll()
SIGMOID_DPO = PairLoss(dpo_terms)
ODDS_RATIO = PairLoss(orpo_terms)
TOKEN_NLL_AND_SIGMOID_DPO = PairLoss(dpo_terms, with_sft=True)
CLIPPED_POLICY_GRADIENT = PolicyGradient()


def loss_of(objective: Objective) -> Loss:
    """The `Loss` the entry names."""
    loss = globals().get(objective.loss)
    if not isinstance(loss, Loss):
        raise ValueError(
            f"objective {objective.name}: no Loss named {objective.loss!r} in train/objectives.py"
        )
    return loss
