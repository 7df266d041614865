"""The actors that answer the episode loop's turns, for every episode source: a local checkpoint, an
OpenAI-compatible endpoint, the oracle and the random policy.

Every actor has one interface (`Policy`): `act(requests) -> [Reply | PolicyError]`, a batch of
conversations per call. A `Reply` carries the text and, when the actor has them, the token ids it sampled
and their log-probabilities (the checkpoint actor: the engine's own ids and log-probs). The oracle and random
policies are privileged (they read the environment): `for_episode` makes each episode's `Solver`, which
the request carries (`ActRequest.solver`) and whose `next_action(env, history)` the actor writes as a ReAct
turn, so it goes through the protocol's reply format and parser like a model's reply. The checkpoint actor
keeps state across turns inside it: each request names its conversation (`ActRequest.key`, one per
episode-sample), the checkpoint actor keeps that conversation's KV cache between turns (prefilling only
what is new) and the loops call `forget(key)` when the episode ends.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from agentrefine_jax.layout import CHECK_VALID_ACTIONS
from agentrefine_jax.layout import assistant_turn as format_response
from agentrefine_jax.outputs import json_dumps

# The model's turn ends with its action; a hallucinated next observation is cut here.
DEFAULT_STOP = ("\nObservation:",)


class PolicyError(Exception):
    """A reply could not be produced for one request (returned in place of the reply)."""


class ContextOverflow(PolicyError):
    """The conversation no longer fits the model's context; AgentBoard ends the episode here."""


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = DEFAULT_STOP


@dataclasses.dataclass(frozen=True)
class Reply:
    """One actor's answer to one request. `token_ids`/`logprobs` (None: the actor has none, e.g. an
    endpoint or a reference solver) are every id the actor sampled, in order, and each one's
    log-probability under the model's raw logits; `text` is what they decode to, cut at a stop string."""

    text: str
    token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None


def as_reply(reply: Reply | str) -> Reply:
    """A plug-in actor (or AgentBoard model backend) may answer with plain text: it carries no ids."""
    return reply if isinstance(reply, Reply) else Reply(reply)


class Solver(Protocol):
    """A privileged actor's per-episode reference solver (a gold path, a planner, the seeded random choice):
    the next action for the episode's environment and its Observation/Action history."""

    def next_action(self, env: Any, history: list[tuple[str, str]]) -> str: ...


@dataclasses.dataclass
class ActRequest:
    """One conversation a model actor answers."""

    messages: list[dict[str, str]]
    # Per episode-sample seed; backends mix in the step number.
    seed: int = 0
    step: int = 0
    # None: the actor's own sampling settings.
    sampling: SamplingParams | None = None
    # For privileged policies: the episode's environment, its Observation/Action history and the solver
    # `for_episode` made for it.
    env: Any = None
    history: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    solver: Solver | None = None
    # The conversation (episode id + Best-of-N sample), distinct among the requests in flight: an actor may
    # keep state for it between turns until `forget(key)`. None: nothing is kept.
    key: Hashable | None = None


class Policy(Protocol):
    """An actor, every kind: answers a batch of conversations in one call (a batched generate, concurrent
    HTTP requests, or each request's solver). A privileged actor (oracle, random) also has
    `for_episode(task, env, spec, seed) -> Solver`, and reads each request's `solver`."""

    name: str
    # Whether environments must prepare reference-solver data (e.g. ScienceWorld gold paths).
    needs_oracle: bool

    def act(self, requests: Sequence[ActRequest]) -> list[Reply | PolicyError]:
        """One reply per request. Raising fails the whole batch; `ask` then retries one by one."""
        ...

    def forget(self, key: Hashable) -> None:
        """The conversation `key` is over (state kept for it may go)."""
        ...

    def close(self) -> None: ...


def forget(policy: Any, key: Hashable | None) -> None:
    """Tell a model actor an episode ended (plug-in actors without `forget` keep nothing to free)."""
    release = getattr(policy, "forget", None)
    if key is not None and callable(release):
        release(key)


def ask(policy: Any, requests: list[ActRequest]) -> list[Reply | Exception]:
    """A batched call; a batch-level failure is retried per request so one bad episode fails alone."""
    try:
        replies = policy.act(requests)
        if len(replies) != len(requests):
            raise RuntimeError(f"policy returned {len(replies)} replies for {len(requests)} requests")
        return [r if isinstance(r, Exception) else as_reply(r) for r in replies]
    except Exception as e:  # noqa: BLE001
        if len(requests) == 1:
            return [PolicyError(f"{type(e).__name__}: {e}")]
        return [r for req in requests for r in ask(policy, [req])]


def is_privileged(policy: Any) -> bool:
    return callable(getattr(policy, "for_episode", None))


class PrivilegedPolicy:
    """A privileged actor: each request's solver picks the action, written as a ReAct turn (`thought`) that
    goes through the same parser as a model's reply."""

    name: str
    needs_oracle: bool
    thought: str
    # whether its solver depends on the seed it is made with (the runner reuses a seedless one's episode
    # for every seed: its Best-of-N samples and greedy run are one run)
    seeded = True

    def act(self, requests: Sequence[ActRequest]) -> list[Reply | PolicyError]:
        out: list[Reply | PolicyError] = []
        for r in requests:
            if r.solver is None:
                raise ValueError(f"{self.name}: a request without its episode's solver (for_episode)")
            out.append(Reply(format_response(self.thought, r.solver.next_action(r.env, r.history))))
        return out

    def close(self) -> None:
        pass


class OraclePolicy(PrivilegedPolicy):
    """The task's reference solver (BabyAIBot, gold path, a planner, a walkthrough), made per episode."""

    name = "oracle"
    needs_oracle = True
    seeded = False
    thought = "I follow the reference solver."

    def for_episode(self, task: Any, env: Any, spec: Any, seed: int) -> Solver:
        oracle = task.oracle(env)
        if oracle is None:
            raise ValueError(f"task {getattr(task, 'name', task)!r} has no offline oracle")
        return oracle


class Replay:
    """A per-episode reference solver that replays a fixed action list (a gold path, a plan, a walkthrough; a
    callable is read at the first step), then asks for the valid actions."""

    def __init__(self, actions: Sequence[str] | Callable[[], Sequence[str]]):
        self._actions = actions
        self._left: list[str] | None = None

    def next_action(self, env: Any, history: list[tuple[str, str]]) -> str:
        if self._left is None:
            self._left = list(self._actions() if callable(self._actions) else self._actions)
        return self._left.pop(0) if self._left else CHECK_VALID_ACTIONS


class RandomPolicy(PrivilegedPolicy):
    """Uniform choice among the actions valid now (help commands excluded); its solver is a seeded copy per
    episode (a floor for every metric). A task whose help lists templates rather than actions offers
    `candidate_actions()`."""

    name = "random"
    needs_oracle = False
    thought = "I pick a valid action at random."

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def for_episode(self, task: Any, env: Any, spec: Any, seed: int) -> RandomPolicy:
        return RandomPolicy(seed)

    def next_action(self, env: Any, history: list[tuple[str, str]]) -> str:
        listing = getattr(env, "candidate_actions", env.valid_actions)()
        choices = [a for a in listing if "check" not in a.lower()] or listing
        return self.rng.choice(choices) if choices else CHECK_VALID_ACTIONS


class OpenAIChatPolicy:
    """Any OpenAI-compatible /v1/chat/completions endpoint, requests sent concurrently.

    The API key is read from the environment variable named by `api_key_env` and never logged;
    local servers that need no key get a placeholder.

    `tool_calls`: drive a tool-calling model. The task's action is offered as one `act` tool (the
    function data/react_tools.py trains with), the conversation's earlier ReAct turns are sent as that
    tool's calls and results (`react_tool_messages`), and a reply's `act` call comes back as the ReAct
    turn it stands for (`react_action`), which the protocol parses as any model's turn. A reply
    without a call is its text, read as usual (no `Action:` line: a format error).
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
        tool_calls: bool = False,
    ):
        import openai

        from agentrefine_jax.http_client import openai_client

        # The results record it (`policy`): a tool-calling run is told apart from a text run.
        self.name = f"openai:{model}" + (" (tool calls)" if tool_calls else "")
        self.model = model
        self.sampling = sampling
        self.tool_calls = tool_calls
        self._openai = openai
        self._key = os.environ.get(api_key_env) or "EMPTY"
        # `timeout` bounds each whole request (connect + reply), not each read.
        self._client = openai_client(base_url, self._key, timeout=timeout, max_retries=max_retries)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency))

    def _one(self, r: ActRequest) -> Reply | PolicyError:
        s = r.sampling or self.sampling
        tools: dict[str, Any] = {}
        messages: list[dict[str, Any]] = list(r.messages)
        if self.tool_calls:
            from agentrefine_jax.data.react_tools import ACT_TOOL, react_tool_messages

            messages = [_wire(m) for m in react_tool_messages(messages)]
            tools = {"tools": [ACT_TOOL]}
        try:
            resp = self._client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                stop=list(s.stop)[:4] or None,
                seed=(r.seed + r.step) % 2**31,
                **tools,
            )
        except self._openai.APIError as e:
            from agentrefine_jax.http_client import describe_api_error

            return PolicyError(describe_api_error(e, self._key))  # one line, key redacted, no raw body
        if not resp.choices:
            return PolicyError("the endpoint returned no choices")
        message = resp.choices[0].message
        if self.tool_calls and message.tool_calls:
            return Reply(_react_turn(message.content or "", message.tool_calls))
        return Reply(message.content or "")  # an endpoint's text only: no ids

    def act(self, requests: Sequence[ActRequest]) -> list[Reply | PolicyError]:
        return list(self._pool.map(self._one, requests))

    def forget(self, key: Hashable) -> None:
        pass  # the endpoint's own prefix cache (if any) is not ours to manage

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


def _wire(message: dict[str, Any]) -> dict[str, Any]:
    """A message as OpenAI's API sends it: a call's arguments as a JSON string."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json_dumps(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _react_turn(content: str, calls: Sequence[Any]) -> str:
    """An endpoint's tool calls as the ReAct turn they stand for; calls that are not one `act` call
    with a `command` (or whose arguments are not JSON) leave the reply its text."""
    from agentrefine_jax.data.react_tools import react_action

    try:
        read = [
            {"function": {"name": c.function.name, "arguments": json.loads(c.function.arguments or "{}")}}
            for c in calls
        ]
        return react_action(content, read)
    except (ValueError, AttributeError, TypeError):  # json's errors are ValueErrors
        return content


class CheckpointPolicy:
    """A local checkpoint through `agentrefine_jax.inference.chat.ChatGenerator` (one batched call per turn).

    Prompts use the checkpoint's training chat template, so system-prompt placement and control-token
    escaping match fine-tuning. With `kv_reuse` (the default) requests that carry a key keep their
    conversation's KV cache between turns (`ChatGenerator.complete(keys=...)`): a turn prefills only the
    tokens after the longest common prefix with what the cache holds; greedy replies are the same without.
    Replies carry the engine's sampled ids and their log-probabilities (`inference/engine.Generation`).
    """

    needs_oracle = False

    def __init__(
        self,
        checkpoint: str,
        sampling: SamplingParams,
        template: str | None = None,
        generator: Any | None = None,
        *,
        kv_reuse: bool = True,
        load_from: str | None = None,
        dtype: str | None = None,
    ):
        if generator is None:
            from agentrefine_jax.inference.chat import ChatGenerator  # lazy: pulls in JAX and the model
            from agentrefine_jax.paths import as_path

            # `load_from`: the step `checkpoint` resolved to when the run started (eval/model_identity.py)
            generator = ChatGenerator.from_checkpoint(
                load_from or checkpoint, template=template, name=as_path(checkpoint).name, dtype=dtype
            )
        self.generator = generator
        self.name = f"checkpoint:{checkpoint}"
        self.sampling = sampling
        self.kv_reuse = kv_reuse

    @property
    def compute_dtype(self) -> str | None:
        """The dtype the model computes in (None for a generator without a model, e.g. a test double)."""
        model = getattr(self.generator, "model", None)
        return getattr(getattr(model, "cfg", None), "dtype", None)

    def act(self, requests: Sequence[ActRequest]) -> list[Reply | PolicyError]:
        from agentrefine_jax.inference.chat import ContextOverflowError

        s = (requests[0].sampling if requests else None) or self.sampling
        seed = (sum(r.seed for r in requests) + max(r.step for r in requests)) % 2**31
        keys = [r.key for r in requests]
        keyed = self.kv_reuse and None not in keys and len(set(keys)) == len(keys)
        try:
            done = self.generator.complete(
                [r.messages for r in requests],
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                stop=list(s.stop),
                seed=seed,
                keys=keys if keyed else None,
            )
            return [Reply(c.text, c.token_ids, c.logprobs) for c in done]
        except ContextOverflowError as e:
            if len(requests) > 1:
                raise  # the loop retries one by one to find the conversation that overflows
            return [ContextOverflow(str(e))]

    def forget(self, key: Hashable) -> None:
        self.generator.forget(key)

    def close(self) -> None:
        pass
