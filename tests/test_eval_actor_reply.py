"""The one actor interface's reply: the engine-backed actor's `Reply` carries the exact ids the engine
sampled (they decode to its text) and, for greedy decoding, their log-probabilities equal a separate
full forward pass's log-softmax at those ids; text actors' replies carry text only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_generate_chat import CFG, CONVERSATION, numpy_model

from agentrefine_jax.data.templates import get_template
from agentrefine_jax.data.tokenizers import load_tokenizer
from agentrefine_jax.eval.policies import (
    ActRequest,
    CheckpointPolicy,
    RandomPolicy,
    Reply,
    SamplingParams,
    ask,
)
from agentrefine_jax.inference.chat import ChatGenerator

NEW = 12
OTHER = [
    CONVERSATION[0],
    {"role": "user", "content": "Observation: a longer room, with a door to the north."},
]


@pytest.fixture(scope="module")
def gen() -> ChatGenerator:
    return ChatGenerator(numpy_model(CFG, seed=0, std=0.1), get_template("llama3", load_tokenizer("llama3")))


def _forward_logprobs(
    gen: ChatGenerator, prompt: list[int], ids: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """log-softmax of one full forward pass over prompt + reply: at each reply id, and each row's max."""
    seq = jnp.asarray([prompt + list(ids)], jnp.int32)
    logits = gen.model(seq)[0].astype(jnp.float32)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
    return logp[np.arange(len(ids)), list(ids)], logp.max(axis=-1)


@pytest.mark.parametrize("keyed", [False, True])  # a fresh generate, and the per-conversation KV cache
def test_checkpoint_reply_carries_the_sampled_ids_and_their_logprobs(gen, keyed):
    actor = CheckpointPolicy("tiny", SamplingParams(0.0, 1.0, NEW, ()), generator=gen, kv_reuse=keyed)
    requests = [ActRequest(c, key=("ep", i) if keyed else None) for i, c in enumerate([CONVERSATION, OTHER])]
    replies = ask(actor, requests)
    for request, reply in zip(requests, replies, strict=True):
        assert isinstance(reply, Reply)
        ids = reply.token_ids
        assert ids is not None and 0 < len(ids) <= NEW and reply.logprobs is not None
        assert len(reply.logprobs) == len(ids)
        body = list(ids[:-1]) if ids[-1] in gen.stop_token_ids else list(ids)
        assert gen.template.decode(body) == reply.text
        at_ids, row_max = _forward_logprobs(gen, gen.encode(request.messages), ids)
        np.testing.assert_allclose(np.asarray(reply.logprobs), at_ids, rtol=1e-4, atol=1e-4)
        # greedy: each id is the most likely one, so its log-probability is its row's largest
        np.testing.assert_allclose(at_ids, row_max, rtol=1e-5, atol=1e-5)
    for r in requests:
        if r.key is not None:
            actor.forget(r.key)


def test_text_actors_reply_with_text_only():
    class Env:
        def valid_actions(self):
            return ["go north", "check valid actions"]

    policy = RandomPolicy()
    solver = policy.for_episode(None, Env(), {}, seed=1)
    [reply] = ask(policy, [ActRequest([], env=Env(), history=[], solver=solver)])
    assert reply == Reply("Thought: I pick a valid action at random.\nAction: go north")
    assert (reply.token_ids, reply.logprobs) == (None, None)

    class PlainText:  # a plug-in actor answering with plain strings
        def act(self, requests):
            return ["Action: look" for _ in requests]

    assert ask(PlainText(), [ActRequest([])]) == [Reply("Action: look")]
