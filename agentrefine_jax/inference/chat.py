"""Chat-level generation: conversations in, assistant replies out.

Prompts are built by the training chat template's `encode_prompt`, so inference sees the
exact token layout (and system-prompt placement) the model was fine-tuned on, and message
text that looks like a control token is encoded as plain text. Generation stops on the
template's end tokens (plus the model's eos ids) and, at the text level, on stop strings,
which are cut from the reply as the OpenAI API does.

Keyed completion (`complete(..., keys=...)`) names each conversation (an agent episode) so its
KV cache is kept between calls (`sessions.SessionCache`): a turn prefills only the tokens after
what that conversation's cache already holds. `stats` counts prefilled and reused prompt tokens
for both paths, so the two can be compared exactly. `complete_ids` is the same with prompts given as
token ids: a caller that builds a conversation by appending ids (rl/rollout.py) continues from
exactly the ids it holds, never a re-render of the text.

A conversation whose text cannot fit the context is refused before it is tokenized
(`check_fits`): no token of the vocabulary spells more than `longest_token_bytes` bytes, so a text
of more than context x that many bytes needs more tokens than the context holds (tokenizing a
10 MB request took a server 7-10 s before its 400). The bound assumes the template keeps each
message's text (the built-in ones do, up to surrounding whitespace).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from agentrefine_jax.inference.engine import CANCELLED, CancelFn, generate
from agentrefine_jax.inference.loading import LoadedModel, check_chat_names, load_for_inference
from agentrefine_jax.inference.sessions import SessionCache
from agentrefine_jax.models.llama import Transformer
from agentrefine_jax.paths import as_path
from agentrefine_jax.unicode_text import lone_surrogate


class ContextOverflowError(ValueError):
    """A prompt leaves no room for even one new token in the model's context."""


class GenerationCancelled(Exception):
    """`complete(..., cancelled=...)` was cancelled before every reply was finished."""


@dataclasses.dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int  # every generated token, including one that ended the reply
    finish_reason: str  # "stop" | "length"
    # Every id the engine sampled (the ending stop token and any tokens past a stop string's cut
    # included: what the KV cache now holds) and each one's log-probability under the raw logits.
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest occurrence of any stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


class ChatGenerator:
    """Batched chat completion with one model and one chat template."""

    def __init__(self, model: Transformer, template: Any, *, name: str = "model"):
        self.model = model
        self.template = template
        self.name = name
        # Template end tokens (e.g. <|eot_id|>) plus the model's own eos ids, in order.
        ids = list(template.stop_token_ids) + list(model.cfg.eos_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids))
        # Made on the first keyed call, sized to its batch (one cache row per conversation in flight).
        self.sessions: SessionCache | None = None
        # Prompt tokens run through the model (prefill) and taken from a kept cache instead (reused).
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0}

    @classmethod
    def from_checkpoint(
        cls,
        path: str,
        template: str | None = None,
        tokenizer: str | None = None,
        *,
        dtype: str | None = None,
        weights_dtype: str | None = None,
        name: str | None = None,
    ) -> ChatGenerator:
        """Load a project checkpoint or HF directory; template/tokenizer default to its metadata;
        `dtype` overrides the compute dtype, `weights_dtype` the weights' storage dtype."""
        check_chat_names(path, template, tokenizer)  # before the weights: seconds to minutes
        loaded = load_for_inference(path, dtype=dtype, param_dtype=weights_dtype)
        return cls.from_loaded(loaded, template, tokenizer, name=name or as_path(path).name)

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        template: str | None = None,
        tokenizer: str | None = None,
        *,
        name: str = "model",
    ) -> ChatGenerator:
        from agentrefine_jax.data.templates import get_template
        from agentrefine_jax.data.tokenizers import load_tokenizer

        tok_name = tokenizer or loaded.tokenizer
        tpl_name = template or loaded.template
        if tok_name is None:
            raise ValueError("the checkpoint records no tokenizer; pass --tokenizer (llama3, mistral, a dir)")
        if tpl_name is None:
            raise ValueError(
                "the checkpoint records no chat template; pass one (--template llama3, mistral, "
                "or hf with a tokenizer directory that ships a chat_template)"
            )
        tpl = get_template(tpl_name, load_tokenizer(tok_name))
        vocab = len(tpl.tokenizer)
        if vocab > loaded.cfg.vocab_size:
            raise ValueError(
                f"tokenizer {tok_name!r} has {vocab} tokens but the model's vocabulary is "
                f"{loaded.cfg.vocab_size}: they do not belong together"
            )
        return cls(loaded.model, tpl, name=name)

    # ------------------------------------------------------------------ API

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for: the longest vocabulary entry
        in UTF-8 (a byte-level BPE entry spells each byte as one character of 1-2 bytes, a
        SentencePiece one a space as the 3-byte '▁' and a fallback byte as '<0xNN>': never less)."""
        vocab = self.template.tokenizer.get_vocab()
        return max(len(t.encode("utf-8", "surrogatepass")) for t in vocab)

    def check_fits(self, messages: Sequence[Mapping[str, Any]], index: int = 0) -> None:
        """Raise ContextOverflowError when the messages' text is too long for the context whatever
        its tokens; cheap (no tokenizing), so a server can refuse a huge body at once."""
        context = self.model.cfg.max_position_embeddings
        limit = context * self.longest_token_bytes
        size = 0
        for m in messages:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str):
                size += len(content.strip().encode("utf-8", "surrogatepass"))
        if size > limit:
            raise ContextOverflowError(
                f"conversation {index}: {size} bytes of text cannot fit the model's context of {context} "
                f"tokens (at most {limit} bytes: no token spells more than {self.longest_token_bytes})"
            )

    def encode(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        bad_text = lone_surrogate(list(messages), "messages")
        if bad_text:  # the tokenizer would fail deep inside; a ValueError is the caller's 400 / exit 2
            raise ValueError(bad_text)
        return self.template.encode_prompt(messages)

    def complete(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int = 0,
        keys: Sequence[Hashable] | None = None,
        cancelled: CancelFn | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """One reply per conversation (batched). max_new_tokens is reduced to fit the context.

        `keys` (one distinct key per conversation) keeps each conversation's KV cache for its next call;
        `forget(key)` frees it once the conversation is over. Greedy replies are the same either way.
        `cancelled()` is asked between decode chunks; once True the call raises GenerationCancelled.
        `on_text(i, text)` gets conversation i's reply so far (cut at a stop string) after each decode
        chunk while it runs (streaming); a reply's last text is its Completion's.
        """
        for i, c in enumerate(conversations):
            self.check_fits(c, i)
        prompts = [self.encode(c) for c in conversations]
        return self.complete_ids(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=stop,
            seed=seed, keys=keys, cancelled=cancelled, on_text=on_text,
        )  # fmt: skip

    def complete_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int = 0,
        keys: Sequence[Hashable] | None = None,
        cancelled: CancelFn | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """`complete` for prompts given as token ids (no template render): a caller that builds each
        conversation by appending ids (rl/rollout.py: the sampled ids, then the environment's turn)
        continues from exactly those ids, and with `keys` each conversation's KV cache holds them, so
        the next turn prefills only the appended tail and its log-probabilities are of that sequence."""
        prompts = [list(p) for p in prompts]
        if not prompts:
            return []
        context = self.model.cfg.max_position_embeddings
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        room = context - len(prompts[longest])
        if room < 1:
            raise ContextOverflowError(
                f"conversation {longest}: prompt of {len(prompts[longest])} tokens leaves no room in the "
                f"model's context of {context} tokens"
            )
        stops = [s for s in (stop or []) if s]
        stop_ids = set(self.stop_token_ids)

        def reply_text(ids: list[int]) -> str:
            if ids and ids[-1] in stop_ids:
                ids = ids[:-1]
            return self.template.decode(ids)

        def should_stop(row: int, ids: list[int]) -> bool:
            text = reply_text(ids)
            cut = first_stop(text, stops)
            if on_text is not None:
                on_text(row, text if cut is None else text[:cut])
            return cut is not None

        run = dict(
            max_new_tokens=min(max_new_tokens, room),
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            should_stop=should_stop if stops or on_text is not None else None,
            cancelled=cancelled,
        )
        if keys is None:
            gens = generate(self.model, prompts, **run)  # type: ignore[arg-type]
            self.stats["prefill_tokens"] += sum(len(p) for p in prompts)
        else:
            sessions = self._sessions_for(len(prompts))
            before = dict(sessions.stats)
            gens = sessions.generate(keys, prompts, **run)  # type: ignore[arg-type]
            for k in self.stats:
                self.stats[k] += sessions.stats[k] - before[k]
        if any(g.finish_reason == CANCELLED for g in gens):
            raise GenerationCancelled(f"cancelled after {max(len(g.tokens) for g in gens)} tokens")
        out = []
        for prompt, g in zip(prompts, gens, strict=True):
            text = reply_text(g.tokens)
            cut = first_stop(text, stops)
            reason = g.finish_reason
            if cut is not None:
                text, reason = text[:cut], "stop"
            out.append(
                Completion(text, len(prompt), len(g.tokens), reason, tuple(g.tokens), tuple(g.logprobs))
            )
        return out

    def forget(self, key: Hashable) -> None:
        """The conversation `key` is over: its cache row goes to the next new conversation first."""
        if self.sessions is not None:
            self.sessions.forget(key)

    def _sessions_for(self, batch: int) -> SessionCache:
        # Fewer rows than conversations in one call would make them evict each other every turn: a call
        # wider than the cache starts a wider one (once per run: the loop's width is fixed).
        if self.sessions is None or len(self.sessions.slots) < batch:
            self.sessions = SessionCache(self.model, slots=batch)
        return self.sessions

    def chat(
        self,
        conversations: list[list[dict]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int = 0,
        keys: Sequence[Hashable] | None = None,
    ) -> list[str]:
        """Reply texts only; see `complete`."""
        done = self.complete(
            conversations,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            keys=keys,
        )
        return [c.text for c in done]
