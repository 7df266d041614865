"""Preference objectives (DPO, ORPO, SFT + DPO) over packed pair rows.

A batch row holds packing units (data/pipeline.py): SFT examples (loss_mask 1 on their trained
tokens) and pairs, a pair being two consecutive segments s (chosen, loss_mask CHOSEN on its
reply) and s+1 (rejected, loss_mask REJECTED). A sequence's log-probability is the sum of its
reply tokens' log-probabilities, found per segment with one segment sum per row.

Formulas (TRL's documented ones; tests/test_train_preference.py checks them against an
independent PyTorch implementation):
- DPO (sigmoid): h = (pi_c - pi_r) - (ref_c - ref_r); loss = -log sigmoid(beta * h);
  rewards chosen/rejected = beta * (pi - ref) of each reply.
- ORPO: with p = the mean token log-probability of each reply, log odds = (p_c - p_r) -
  (log(1 - e^p_c) - log(1 - e^p_r)); loss = NLL_c - beta * log sigmoid(log odds), NLL_c the mean
  token NLL of the chosen reply; rewards = beta * p. (TRL averages the NLL over the chosen tokens
  of the whole batch; here each pair's own mean, so a pair weighs the same whatever its length.)
- SFT + DPO: sft_weight * (SFT token loss sum / SFT tokens) + dpo_weight * (DPO loss sum / pairs).
Every mean is over the global batch: callers pass the global counts, so micro batches and
devices add sums (never a mean of means).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from agentrefine_jax.data.preference import CHOSEN, REJECTED

PREFERENCE_OBJECTIVES = ("dpo", "orpo", "sft+dpo")
NEEDS_REFERENCE = ("dpo", "sft+dpo")
METRICS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")


def token_logps(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """log p(target) per position, [B, T] float32; the vocabulary projection chunk by chunk
    (each chunk rematerialised in the backward pass: no [B, T, V] logits live)."""
    b, t, d = hidden.shape
    chunk = max(1, min(chunk, t))
    pad = (-t) % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (t + pad) // chunk
    hs = jnp.moveaxis(hidden.reshape(b, n, chunk, d), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, n, chunk), 1, 0)
    w = lm_head.astype(hidden.dtype)

    @jax.checkpoint
    def one(h: jax.Array, tgt: jax.Array) -> jax.Array:
        logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0] - lse

    out = jax.lax.map(lambda xs: one(*xs), (hs, ts))  # [n, B, chunk]
    return jnp.moveaxis(out, 0, 1).reshape(b, -1)[:, :t]


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


def dpo_terms(pi: dict[str, jax.Array], ref: dict[str, jax.Array], beta: float) -> dict[str, jax.Array]:
    """Per slot: loss and rewards of sigmoid DPO (invalid slots are the caller's to mask)."""
    logits = (pi["chosen"] - pi["rejected"]) - (ref["chosen"] - ref["rejected"])
    return {
        "loss": -jax.nn.log_sigmoid(beta * logits),
        "rewards_chosen": beta * jax.lax.stop_gradient(pi["chosen"] - ref["chosen"]),
        "rewards_rejected": beta * jax.lax.stop_gradient(pi["rejected"] - ref["rejected"]),
    }


def orpo_terms(pi: dict[str, jax.Array], beta: float) -> dict[str, jax.Array]:
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


def preference_sums(
    objective: str,
    logp: jax.Array,
    ref_logp: jax.Array | None,
    batch: dict[str, jax.Array],
    *,
    beta: float,
    sft_weight: float,
    dpo_weight: float,
    n_tokens: jax.Array,
    n_pairs: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This (micro) batch's share of the global loss (global counts given), and metric sums."""
    pi = pair_logps(logp, batch)
    if objective == "orpo":
        terms = orpo_terms(pi, beta)
    else:
        terms = dpo_terms(pi, pair_logps(jax.lax.stop_gradient(ref_logp), batch), beta)
    valid = pi["valid"]
    pair_loss = jnp.sum(terms["loss"] * valid)
    weight = dpo_weight if objective == "sft+dpo" else 1.0
    loss = weight * pair_loss / jnp.maximum(n_pairs, 1.0)
    aux = {
        "pair_loss": pair_loss,
        "rewards_chosen": jnp.sum(terms["rewards_chosen"] * valid),
        "rewards_rejected": jnp.sum(terms["rewards_rejected"] * valid),
        "margin": jnp.sum((terms["rewards_chosen"] - terms["rewards_rejected"]) * valid),
        "accuracy": jnp.sum((terms["rewards_chosen"] > terms["rewards_rejected"]) * valid),
        "sft_loss": jnp.zeros((), jnp.float32),
    }
    if objective == "sft+dpo":
        kind, _ = _target_kinds(batch)
        sft_sum = -jnp.sum(jnp.where(kind == 1, logp, 0.0))
        loss = loss + sft_weight * sft_sum / jnp.maximum(n_tokens, 1.0)
        aux["sft_loss"] = jax.lax.stop_gradient(sft_sum)
    return loss, aux


def finish_metrics(aux: dict[str, Any], n_pairs: jax.Array, n_tokens: jax.Array) -> dict[str, jax.Array]:
    """Sums over the global batch -> the logged means."""
    p = jnp.maximum(n_pairs, 1.0)
    out = {k: aux[k] / p for k in METRICS}
    out["pair_loss"] = aux["pair_loss"] / p
    out["pairs"] = n_pairs
    out["sft_loss"] = aux["sft_loss"] / jnp.maximum(n_tokens, 1.0)
    return out
