"""Vendor-exact chat templates that also produce the per-token loss mask.

`llama3`  - Meta's `ChatFormat`: <|begin_of_text|>, then per message
            <|start_header_id|>ROLE<|end_header_id|>\\n\\n CONTENT <|eot_id|>. Content is NOT trimmed
            (the vendor encoder does not trim).
`mistral` - mistral-common v3 `encode_instruct`: <s>[INST] USER [/INST] ASSISTANT</s>[INST] ...
            (assistant content right-stripped of spaces, as the vendor does). The system
            prompt is prepended to the FIRST user turn ("SYSTEM\\n\\nUSER"), not the last as
            the vendor's inference encoder does: in training, a system prompt in the last user
            turn would be invisible to every earlier assistant turn. `encode_prompt` uses the
            same placement so inference sees what training saw.

Message content is always encoded as plain text: text that looks like a control token
(`<|eot_id|>`, `[INST]`, `</s>`, ...) becomes ordinary tokens, so an observation cannot
inject a turn. Only the template itself emits special tokens.

mask[i] == 1 iff ids[i] is a token the loss trains the model to produce: the content and
the end token (<|eot_id|> / </s>) of assistant turns whose category is in `loss_on`; never
headers, [INST] markup, BOS, system or user text.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentrefine_jax.data.schema import (
    DEFAULT_LOSS_ON,
    RowError,
    assistant_categories,
    check_loss_on,
    validate_messages,
)

TEMPLATES = ("llama3", "mistral", "hf")

# A template renders a conversation as a list of parts: literal token ids, or text to be
# encoded as plain text. Text parts of many conversations are then encoded in one batch.
Part = tuple[str, Any, int, int]  # ("ids" | "text", payload, mask bit, message index)


_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain_backend(tokenizer: PreTrainedTokenizerBase, backend: Any) -> Any:
    """A private copy of the backend whose added/special tokens are never matched inside text
    (shared by all templates over the same tokenizer object; the copy costs ~1 s for Llama-3)."""
    plain = _PLAIN.get(tokenizer)
    if plain is None:
        plain = copy.deepcopy(backend)
        plain.encode_special_tokens = True
        plain.no_padding()
        plain.no_truncation()
        _PLAIN[tokenizer] = plain
    return plain


class ChatTemplate:
    name: str = ""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer")
        self._plain = _plain_backend(tokenizer, backend)
        self.stop_token_ids: tuple[int, ...] = ()

    # ------------------------------------------------------------------ helpers
    def _special(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if (
            tid is None
            or tid == self.tokenizer.unk_token_id
            or self.tokenizer.convert_ids_to_tokens(tid) != token
        ):
            raise ValueError(f"template {self.name!r}: tokenizer has no special token {token!r}")
        return int(tid)

    def encode_text(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain-text encoding (no BOS/EOS, special-token look-alikes kept as text)."""
        if not texts:
            return []
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def _text_chunks(self, text: str) -> list[str]:
        return [text]

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[Part]:
        raise NotImplementedError

    def _assemble(
        self, parts_list: list[list[Part]], n_messages: list[int]
    ) -> list[tuple[list[int], list[int], list[int]]]:
        texts = [
            chunk
            for parts in parts_list
            for kind, payload, _, _ in parts
            if kind == "text"
            for chunk in payload
        ]
        encoded = iter(self.encode_text(texts))
        out = []
        for parts, n in zip(parts_list, n_messages, strict=True):
            ids: list[int] = []
            mask: list[int] = []
            ends = [0] * n
            for kind, payload, bit, msg_idx in parts:
                if kind == "ids":
                    piece = list(payload)
                else:
                    piece = [t for _ in payload for t in next(encoded)]
                ids.extend(piece)
                mask.extend([bit] * len(piece))
                if msg_idx >= 0:
                    ends[msg_idx] = len(ids)
            for i in range(1, n):  # messages that emitted nothing (system folded into a user turn)
                ends[i] = max(ends[i], ends[i - 1])
            out.append((ids, mask, ends))
        return out

    # ------------------------------------------------------------------ public API
    def encode_batch(
        self, conversations: Sequence[Sequence[Mapping[str, Any]]], loss_on: Collection[str] = DEFAULT_LOSS_ON
    ) -> list[tuple[list[int], list[int], list[int]]]:
        """(ids, mask, ends) per conversation; ends[k] = number of tokens after message k."""
        train = check_loss_on(loss_on)
        msgs = [validate_messages(c) for c in conversations]
        parts = [self._render(m, train) for m in msgs]
        return self._assemble(parts, [len(m) for m in msgs])

    def encode(
        self, messages: Sequence[Mapping[str, Any]], loss_on: Collection[str] = DEFAULT_LOSS_ON
    ) -> tuple[list[int], list[int]]:
        ids, mask, _ = self.encode_batch([messages], loss_on)[0]
        return ids, mask

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt for the next assistant turn (same system placement as training)."""
        msgs = _validate_prompt(messages)
        parts = self._render(msgs, None) + self._generation_header(msgs)
        return self._assemble([parts], [len(msgs)])[0][0]

    def _generation_header(self, messages: list[dict[str, Any]]) -> list[Part]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _validate_prompt(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Prompts may end on a user turn and need no assistant turn yet; roles still alternate."""
    if not messages:
        raise RowError("empty conversation", "no messages")
    probe = [dict(m) for m in messages] + [{"role": "assistant", "content": "x"}]
    if messages[-1].get("role") == "assistant":
        probe = probe[:-1]
    return validate_messages(probe)[: len(messages)]


class Llama3Template(ChatTemplate):
    name = "llama3"
    # llama_models.llama3.tokenizer: TIKTOKEN_MAX_ENCODE_CHARS / MAX_NO_WHITESPACES_CHARS
    _MAX_ENCODE_CHARS = 400_000
    _MAX_RUN_CHARS = 25_000

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.bos = self._special("<|begin_of_text|>")
        self.eot = self._special("<|eot_id|>")
        start, end = self._special("<|start_header_id|>"), self._special("<|end_header_id|>")
        nl = self.encode_text(["\n\n"])[0]
        self.headers = {
            r: [start, *self.encode_text([r])[0], end, *nl] for r in ("system", "user", "assistant")
        }
        self.stop_token_ids = (self.eot, self._special("<|end_of_text|>"), self._special("<|eom_id|>"))

    def _text_chunks(self, text: str) -> list[str]:
        """Meta's encoder splits very long strings before BPE; mirror it so ids stay identical."""
        if len(text) <= self._MAX_RUN_CHARS:
            return [text]
        chunks = []
        for i in range(0, len(text), self._MAX_ENCODE_CHARS):
            chunks.extend(_split_runs(text[i : i + self._MAX_ENCODE_CHARS], self._MAX_RUN_CHARS))
        return chunks

    def _render(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[Part]:
        cats = assistant_categories(messages)
        parts: list[Part] = [("ids", [self.bos], 0, -1)]
        for i, (m, cat) in enumerate(zip(messages, cats, strict=True)):
            bit = int(train is not None and cat is not None and cat in train)
            parts.append(("ids", self.headers[m["role"]], 0, i))
            parts.append(("text", self._text_chunks(m["content"]), bit, i))
            parts.append(("ids", [self.eot], bit, i))
        return parts

    def _generation_header(self, messages: list[dict[str, Any]]) -> list[Part]:
        return [("ids", self.headers["assistant"], 0, -1)]


def _split_runs(s: str, max_len: int) -> list[str]:
    """Port of llama_models' Tokenizer._split_whitespaces_or_nonwhitespaces."""
    out = []
    current_len = 0
    current_is_space = s[0].isspace() if s else False
    start = 0
    for i in range(len(s)):
        is_space = s[i].isspace()
        if current_is_space ^ is_space:
            current_len = 1
            current_is_space = is_space
        else:
            current_len += 1
            if current_len > max_len:
                out.append(s[start:i])
                start = i
                current_len = 1
    out.append(s[start:])
    return out


class MistralTemplate(ChatTemplate):
    name = "mistral"

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.bos = self._special("<s>")
        self.eos = self._special("</s>")
        self.inst = self._special("[INST]")
        self.end_inst = self._special("[/INST]")
        self.stop_token_ids = (self.eos,)

    def _render(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[Part]:
        cats = assistant_categories(messages)
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        parts: list[Part] = [("ids", [self.bos], 0, -1)]
        first_user = True
        for i, (m, cat) in enumerate(zip(messages, cats, strict=True)):
            if m["role"] == "system":
                continue
            if m["role"] == "user":
                text = m["content"]
                if first_user and system:  # same rule as mistral-common v1's first-user placement
                    text = system + "\n\n" + text
                first_user = False
                parts.append(("ids", [self.inst], 0, i))
                parts.append(("text", [text], 0, i))
                parts.append(("ids", [self.end_inst], 0, i))
            else:
                bit = int(train is not None and cat is not None and cat in train)
                parts.append(("text", [m["content"].rstrip(" ")], bit, i))
                parts.append(("ids", [self.eos], bit, i))
        return parts

    def _generation_header(self, messages: list[dict[str, Any]]) -> list[Part]:
        if messages[-1]["role"] != "user":
            raise RowError(
                "role order", "a Mistral prompt must end with a user turn ([/INST] starts the reply)"
            )
        return []


def hf_chat_template(hf_dir: str | pathlib.Path) -> bool:
    """Whether a directory ships a chat template (chat_template.jinja or tokenizer_config.json's
    `chat_template`): then `hf`, its own template, is the default wherever it is the tokenizer."""
    d = pathlib.Path(hf_dir)
    if (d / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


_SENTINEL = re.compile("\ue000(\\d+)\ue001")


class HFDirTemplate(ChatTemplate):
    """The Jinja `chat_template` a Hugging Face model directory ships (its tokenizer_config.json),
    for families without a vendor encoder (models/families.py; e.g. Qwen2.5).

    The template is rendered (sandboxed, as transformers does) with each message's content
    replaced by a sentinel; the text between sentinels is the template's own markup, encoded
    with its special tokens, while message content is encoded as plain text (a control token
    typed in a message stays text). Loss mask: a trained assistant message's content and the
    template's end token after it (the first stop token, e.g. <|im_end|>) — the tokens that
    rendering the conversation prefix by prefix adds for that message
    (tests/test_family_qwen2.py checks ids and masks against transformers' apply_chat_template).
    """

    name = "hf"

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):
            source = source.get("default")
        if not isinstance(source, str) or not source:
            raise ValueError(
                "template 'hf': the tokenizer directory has no chat_template (tokenizer_config.json)"
            )
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._jinja = env.from_string(source)
        self._specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop_token_ids = tuple(int(i) for i in eos)
        if not self.stop_token_ids:
            raise ValueError("template 'hf': the tokenizer directory names no eos_token to end a turn")
        self._backend = tokenizer.backend_tokenizer

    def _markup(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids if text else []

    def _render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError

        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        try:
            text = self._jinja.render(
                messages=marked, add_generation_prompt=add_generation_prompt, **self._specials
            )
        except TemplateError as e:
            raise RowError(
                "chat template", f"the directory's chat_template refused the conversation: {e}"
            ) from None
        if [int(i) for i in _SENTINEL.findall(text)] != list(range(len(messages))):
            raise RowError(
                "chat template",
                "the directory's chat_template does not emit each message's content once, in order "
                "(it transforms or drops content); it cannot be used for training",
            )
        return text

    def _render(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[Part]:
        if any(ch in m["content"] for m in messages for ch in "\ue000\ue001"):
            raise RowError("chat template", "message text contains the private-use characters U+E000/U+E001")
        cats = assistant_categories(messages)
        pieces = _SENTINEL.split(self._render_text(messages, False))
        parts: list[Part] = [("ids", self._markup(pieces[0]), 0, -1)]
        stops = set(self.stop_token_ids)
        for k in range(len(messages)):
            bit = int(train is not None and cats[k] is not None and cats[k] in train)
            parts.append(("text", [messages[k]["content"]], bit, k))
            after = self._markup(pieces[2 * k + 2])
            # The message's end token belongs to it (and is trained with it); the rest is the
            # next message's header.
            cut = next((j + 1 for j, t in enumerate(after) if t in stops), 0)
            parts.append(("ids", after[:cut], bit, k))
            parts.append(("ids", after[cut:], 0, k + 1 if k + 1 < len(messages) else k))
        return parts

    def _generation_header(self, messages: list[dict[str, Any]]) -> list[Part]:
        plain = self._render_text(messages, False)
        prompt = self._render_text(messages, True)
        if not prompt.startswith(plain):
            raise RowError("chat template", "add_generation_prompt changes earlier turns of the conversation")
        return [("ids", self._markup(prompt[len(plain) :]), 0, -1)]


_TEMPLATE_CLASSES = {"llama3": Llama3Template, "mistral": MistralTemplate, "hf": HFDirTemplate}


def get_template(name: str, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
    if name not in _TEMPLATE_CLASSES:
        raise ValueError(f"unknown chat template {name!r}; choose from {TEMPLATES}")
    return _TEMPLATE_CLASSES[name](tokenizer)
