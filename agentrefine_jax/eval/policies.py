"""Policies that answer the agent loop's turns: oracle, random, an OpenAI-compatible endpoint, or a
local checkpoint. All four implement `Policy`, so the loop, metrics and CLI treat them alike.

The oracle and random policies are privileged (they read the environment through `ActRequest.env`)
but still answer with a ReAct text turn that goes through the same parser as a model's reply.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
from collections.abc import Sequence
from typing import Any, Protocol

from agentrefine_jax.eval.envs.base import TextEnv
from agentrefine_jax.eval.react import CHECK_VALID_ACTIONS, format_response

# The model's turn ends with its action; a hallucinated next observation is cut here.
DEFAULT_STOP = ("\nObservation:",)


class PolicyError(Exception):
    """A reply could not be produced for one request (returned in place of the reply)."""


class ContextOverflow(PolicyError):
    """The conversation no longer fits the model's context; AgentBoard ends the episode here."""


@dataclasses.dataclass
class ActRequest:
    messages: list[dict[str, str]]
    env: TextEnv
    # Per episode-sample stream for policies that sample on the host (random).
    rng: random.Random
    # Per episode-sample seed; LLM backends mix in the step number.
    seed: int
    step: int


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = DEFAULT_STOP


class Policy(Protocol):
    name: str
    # Whether environments must prepare reference-solver data (e.g. ScienceWorld gold paths).
    needs_oracle: bool

    def act(self, requests: Sequence[ActRequest]) -> list[str | PolicyError]:
        """One reply per request. Raising fails the whole batch; the loop then retries one by one."""
        ...

    def close(self) -> None: ...


class OraclePolicy:
    """Replies with the environment's reference solver action (BabyAIBot, gold path, BFS, walkthrough)."""

    name = "oracle"
    needs_oracle = True

    def act(self, requests: Sequence[ActRequest]) -> list[str | PolicyError]:
        return [format_response("I follow the reference solver.", r.env.oracle_action()) for r in requests]

    def close(self) -> None:
        pass


class RandomPolicy:
    """Uniform choice among the currently valid actions (a floor for every metric)."""

    name = "random"
    needs_oracle = False

    def act(self, requests: Sequence[ActRequest]) -> list[str | PolicyError]:
        out: list[str | PolicyError] = []
        for r in requests:
            valid = r.env.valid_actions()
            action = r.rng.choice(valid) if valid else CHECK_VALID_ACTIONS
            out.append(format_response("I pick a valid action at random.", action))
        return out

    def close(self) -> None:
        pass


class OpenAIChatPolicy:
    """Any OpenAI-compatible /v1/chat/completions endpoint, requests sent concurrently.

    The API key is read from the environment variable named by `api_key_env` and never logged;
    local servers that need no key get a placeholder.
    """

    needs_oracle = False

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: SamplingParams,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout: float = 120.0,
        max_retries: int = 2,
    ):
        import openai

        from agentrefine_jax.http_client import openai_client

        self.name = f"openai:{model}"
        self.model = model
        self.sampling = sampling
        self._openai = openai
        self._key = os.environ.get(api_key_env) or "EMPTY"
        # `timeout` bounds each whole request (connect + reply), not each read.
        self._client = openai_client(base_url, self._key, timeout=timeout, max_retries=max_retries)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency))

    def _one(self, r: ActRequest) -> str | PolicyError:
        s = self.sampling
        try:
            resp = self._client.chat.completions.create(
                model=self.model,
                messages=r.messages,  # type: ignore[arg-type]
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                stop=list(s.stop)[:4] or None,
                seed=(r.seed + r.step) % 2**31,
            )
        except self._openai.APIError as e:
            from agentrefine_jax.http_client import describe_api_error

            return PolicyError(describe_api_error(e, self._key))  # one line, key redacted, no raw body
        if not resp.choices:
            return PolicyError("the endpoint returned no choices")
        return resp.choices[0].message.content or ""

    def act(self, requests: Sequence[ActRequest]) -> list[str | PolicyError]:
        return list(self._pool.map(self._one, requests))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


class CheckpointPolicy:
    """A local checkpoint through `agentrefine_jax.inference.chat.ChatGenerator` (one batched call per turn).

    Prompts use the checkpoint's training chat template, so system-prompt placement and control-token
    escaping match fine-tuning.
    """

    needs_oracle = False

    def __init__(
        self,
        checkpoint: str,
        sampling: SamplingParams,
        template: str | None = None,
        generator: Any | None = None,
    ):
        if generator is None:
            from agentrefine_jax.inference.chat import ChatGenerator  # lazy: pulls in JAX and the model

            generator = ChatGenerator.from_checkpoint(checkpoint, template=template)
        self._gen = generator
        self.name = f"checkpoint:{checkpoint}"
        self.sampling = sampling

    def act(self, requests: Sequence[ActRequest]) -> list[str | PolicyError]:
        from agentrefine_jax.inference.chat import ContextOverflowError

        s = self.sampling
        seed = (sum(r.seed for r in requests) + max(r.step for r in requests)) % 2**31
        try:
            return list(
                self._gen.chat(
                    [r.messages for r in requests],
                    max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    stop=list(s.stop),
                    seed=seed,
                )
            )
        except ContextOverflowError as e:
            if len(requests) > 1:
                raise  # the loop retries one by one to find the conversation that overflows
            return [ContextOverflow(str(e))]

    def close(self) -> None:
        pass
