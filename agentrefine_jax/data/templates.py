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
the end token (<|eot_id|> / </s>) of assistant turns whose category is in `loss_on` (with their
tool calls and, where the template renders it, their thinking); never headers, [INST] markup,
BOS, system, user or tool text.

Tool calls (schema.py): `llama3` renders Llama-3.1's JSON tool calls (Meta's ChatFormat: the
call as {"type": "function", "name", "parameters"} after the content, <|eom_id|> ending the
turn, tool results in `ipython` turns, the function list in the system message); `mistral`
renders v3's [AVAILABLE_TOOLS] / [TOOL_CALLS] / [TOOL_RESULTS]; `hf` passes `tools`,
`tool_calls` and `reasoning_content` to the directory's template (Qwen's Hermes <tool_call>).
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

    def _bit(self, train: frozenset[str] | None, cat: str | None, m: Mapping[str, Any]) -> int:
        return int(train is not None and cat is not None and cat in train and not m.get("_context"))

    # ------------------------------------------------------------------ public API
    def contexts(
        self, messages: Sequence[Mapping[str, Any]], loss_on: Collection[str] = DEFAULT_LOSS_ON
    ) -> list[list[dict[str, Any]]]:
        """The conversation as the examples it trains: each a prefix of it in which some turns are
        trained and earlier ones are context (`_context`). Append-only templates give the
        conversation itself; `hf` splits where the template renders a turn differently later on
        (Qwen3 drops earlier thoughts), so every turn is trained in the context inference sees.
        (Here the conversation as given: encoding validates it.)"""
        return [list(messages)]

    def encode_contexts(
        self, messages: Sequence[Mapping[str, Any]], loss_on: Collection[str] = DEFAULT_LOSS_ON
    ) -> list[tuple[list[int], list[int]]]:
        """(ids, mask) of each example `contexts` makes of one conversation."""
        return [(ids, mask) for ids, mask, _ in self.encode_batch(self.contexts(messages, loss_on), loss_on)]

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
            r: [start, *self.encode_text([r])[0], end, *nl]
            for r in ("system", "user", "assistant", "ipython")
        }
        self.headers["tool"] = self.headers["ipython"]  # Llama-3.1's role for tool results
        self.eom = self._special("<|eom_id|>")
        self.stop_token_ids = (self.eot, self._special("<|end_of_text|>"), self.eom)

    def _text_chunks(self, text: str) -> list[str]:
        """Meta's encoder splits very long strings before BPE; mirror it so ids stay identical."""
        if len(text) <= self._MAX_RUN_CHARS:
            return [text]
        chunks = []
        for i in range(0, len(text), self._MAX_ENCODE_CHARS):
            chunks.extend(_split_runs(text[i : i + self._MAX_ENCODE_CHARS], self._MAX_RUN_CHARS))
        return chunks

    def _render(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[Part]:
        _no_thinking(self.name, messages)
        cats = assistant_categories(messages)
        parts: list[Part] = [("ids", [self.bos], 0, -1)]
        tools = messages[0].get("tools")
        if tools and messages[0]["role"] != "system":  # the function list needs a system turn
            parts.append(("ids", self.headers["system"], 0, -1))
            parts.append(("text", self._text_chunks(llama3_tools_system(None, tools)), 0, -1))
            parts.append(("ids", [self.eot], 0, -1))
        for i, (m, cat) in enumerate(zip(messages, cats, strict=True)):
            bit = self._bit(train, cat, m)
            content = m["content"]
            if i == 0 and tools and m["role"] == "system":
                content = llama3_tools_system(content, tools)
            parts.append(("ids", self.headers[m["role"]], 0, i))
            # Meta's ChatFormat encodes the content and each call as separate strings.
            calls = [llama3_tool_call(c) for c in m.get("tool_calls", ())]
            parts.append(("text", [t for text in (content, *calls) for t in self._text_chunks(text)], bit, i))
            # A turn that calls a tool ends with <|eom_id|>: the model waits for the result
            # (Meta's StopReason.end_of_message); a final answer ends with <|eot_id|>.
            parts.append(("ids", [self.eom if calls else self.eot], bit, i))
        return parts

    def _generation_header(self, messages: list[dict[str, Any]]) -> list[Part]:
        return [("ids", self.headers["assistant"], 0, -1)]


# Llama-3.1's JSON tool calling (llama_models' prompt_format.md), its function list placed in
# the system message so that every turn of a trajectory sees it.
LLAMA3_TOOLS_PROMPT = (
    "Environment: ipython\n\n{system}Answer the user's question by making use of the following functions "
    "if needed.\nIf none of the function can be used, please say so.\nHere is a list of functions in JSON "
    "format:\n{tools}\n\nReturn function calls in JSON format."
)


def llama3_tools_system(system: str | None, tools: Sequence[Mapping[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, indent=4) for t in tools)
    return LLAMA3_TOOLS_PROMPT.format(system=f"{system}\n\n" if system else "", tools=listing)


def llama3_tool_call(call: Mapping[str, Any]) -> str:
    """llama_models' ToolUtils.encode_tool_call in the json format."""
    fn = call["function"]
    return json.dumps({"type": "function", "name": fn["name"], "parameters": fn["arguments"]})


def _no_thinking(name: str, messages: Sequence[Mapping[str, Any]]) -> None:
    """Templates without a thinking format refuse reasoning rather than drop it."""
    for i, m in enumerate(messages):
        if m.get("reasoning_content"):
            raise RowError(
                "reasoning",
                f"message {i} has reasoning_content (or <think> in its content) and the {name!r} template "
                "has no thinking format; use a model directory whose template renders it (template hf)",
            )


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

    def _tool_ids(self) -> dict[str, int]:
        # Looked up only for rows with tools: a tokenizer without them still trains plain rows.
        names = (
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        )
        try:
            return {n: self._special(n) for n in names}
        except ValueError as e:
            raise RowError("tool call", str(e)) from None

    def _render(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[Part]:
        _no_thinking(self.name, messages)
        cats = assistant_categories(messages)
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        tools = messages[0].get("tools")
        uses_tools = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        tid = self._tool_ids() if uses_tools else {}
        parts: list[Part] = [("ids", [self.bos], 0, -1)]
        first_user = True
        for i, (m, cat) in enumerate(zip(messages, cats, strict=True)):
            if m["role"] == "system":
                continue
            if m["role"] == "user":
                text = m["content"]
                if first_user and tools:  # same placement as the system prompt (module docstring)
                    listing = json.dumps([mistral_tool(t) for t in tools], ensure_ascii=False)
                    parts.append(("ids", [tid["[AVAILABLE_TOOLS]"]], 0, i))
                    parts.append(("text", [listing], 0, i))
                    parts.append(("ids", [tid["[/AVAILABLE_TOOLS]"]], 0, i))
                if first_user and system:  # same rule as mistral-common v1's first-user placement
                    text = system + "\n\n" + text
                first_user = False
                parts.append(("ids", [self.inst], 0, i))
                parts.append(("text", [text], 0, i))
                parts.append(("ids", [self.end_inst], 0, i))
            elif m["role"] == "tool":
                result = {"content": _json_or_text(m["content"]), "call_id": m["tool_call_id"]}
                parts.append(("ids", [tid["[TOOL_RESULTS]"]], 0, i))
                parts.append(("text", [json.dumps(result, ensure_ascii=False)], 0, i))
                parts.append(("ids", [tid["[/TOOL_RESULTS]"]], 0, i))
            else:
                bit = self._bit(train, cat, m)
                content = m["content"].rstrip(" ")
                if content:
                    parts.append(("text", [content], bit, i))
                if m.get("tool_calls"):
                    # v3 refuses content beside calls; later mistral-common versions (v7+) put the
                    # content first, then [TOOL_CALLS]: so do we, nothing of the turn is dropped.
                    calls = [mistral_tool_call(c) for c in m["tool_calls"]]
                    parts.append(("ids", [tid["[TOOL_CALLS]"]], bit, i))
                    parts.append(("text", [json.dumps(calls, ensure_ascii=False)], bit, i))
                parts.append(("ids", [self.eos], bit, i))
        return parts

    def _generation_header(self, messages: list[dict[str, Any]]) -> list[Part]:
        if messages[-1]["role"] not in ("user", "tool"):
            raise RowError(
                "role order",
                "a Mistral prompt must end with a user or tool turn "
                "([/INST] or [/TOOL_RESULTS] starts the reply)",
            )
        return []


def mistral_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """mistral-common's Tool.model_dump (strict left out)."""
    fn = tool["function"]
    return {
        "type": "function",
        "function": {
            "name": fn["name"],
            "description": fn.get("description", ""),
            "parameters": fn.get("parameters", {}),
        },
    }


def mistral_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """InstructTokenizerV3._prepare_function_call."""
    out = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    if call.get("id") and call["id"] != "null":
        out["id"] = call["id"]
    return out


def _json_or_text(text: str) -> Any:
    """mistral-common puts a tool result that is JSON in as the value, any other as a string."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


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
_FIELDS = ("content", "reasoning_content")  # message text the template places: sentinel n = 2k + field
# What the directory's template sees of a message (our flags loss/train/_context stay out).
_TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


class HFDirTemplate(ChatTemplate):
    """The Jinja `chat_template` a Hugging Face model directory ships (its tokenizer_config.json),
    for families without a vendor encoder (models/families.py; e.g. Qwen2.5, Qwen3).

    The template is rendered (sandboxed, with transformers' `tojson`) with each message's text
    (content, reasoning_content) replaced by a sentinel; the text between sentinels is the
    template's own markup, encoded with its special tokens, while message text is encoded as
    plain text (a control token typed in a message stays text). Tool definitions (`tools`) and
    calls (`tool_calls`) are the template's to render, as in transformers' apply_chat_template;
    `enable_thinking` is passed when set. A render whose sentinels, filled in, differ from the
    render of the real text (the template strips or rewrites message text) is refused.

    Loss mask, per trained assistant turn k: exactly the tokens inference would have to produce
    after the prompt `render(messages[:k], add_generation_prompt=True)`, up to and including the
    end token (the first stop token, e.g. <|im_end|>) - thinking, content and tool calls of the
    turn. A template that is not append-only (Qwen3 drops the thoughts of turns before the last
    user query) renders turn k differently once later turns follow: `contexts` then splits the
    conversation so each trained turn is trained in the context it was generated in
    (tests/test_family_qwen2.py, tests/test_data_tool_calls.py check ids and masks against
    transformers' apply_chat_template).
    """

    name = "hf"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, enable_thinking: bool | None = None):
        super().__init__(tokenizer)
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):
            source = source.get("default")
        if not isinstance(source, str) or not source:
            raise ValueError(
                "template 'hf': the tokenizer directory has no chat_template (tokenizer_config.json)"
            )
        import datetime

        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
            # transformers' filter: Jinja's own escapes <, >, & and ' (a different text).
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._jinja = env.from_string(source)
        self._specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop_token_ids = tuple(int(i) for i in eos)
        if not self.stop_token_ids:
            raise ValueError("template 'hf': the tokenizer directory names no eos_token to end a turn")
        self._end_text = tokenizer.convert_ids_to_tokens(self.stop_token_ids[0])
        self._control_texts = [t for t in tokenizer.all_special_tokens if t]
        self._backend = tokenizer.backend_tokenizer
        self.enable_thinking = enable_thinking
        self._shown: dict[tuple[int, int, bool], tuple[Mapping[str, Any], dict[str, Any]]] = {}
        self._spans: dict[tuple[Any, ...], tuple[str, str]] = {}

    def _markup(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids if text else []

    # ------------------------------------------------------------------ rendering text
    def _template_messages(self, messages: Sequence[Mapping[str, Any]], marked: bool) -> list[dict[str, Any]]:
        out = []
        for k, m in enumerate(messages):
            # A row's prefixes are rendered many times: each message is converted once per call.
            memo = self._shown.get((id(m), k, marked))
            if memo is None or memo[0] is not m:
                msg = {key: m[key] for key in _TEMPLATE_KEYS if key in m}
                if marked:
                    for f, field in enumerate(_FIELDS):
                        if msg.get(field):  # empty text stays empty: templates test it (`if content`)
                            msg[field] = f"\ue000{2 * k + f}\ue001"
                memo = self._shown[(id(m), k, marked)] = (m, msg)
            out.append(memo[1])
        return out

    def _jinja_render(self, messages: Sequence[Mapping[str, Any]], gen: bool, marked: bool) -> str:
        from jinja2.exceptions import TemplateError

        extra: dict[str, Any] = {}
        if messages and messages[0].get("tools"):
            extra["tools"] = messages[0]["tools"]
        if self.enable_thinking is not None:
            extra["enable_thinking"] = self.enable_thinking
        try:
            return self._jinja.render(
                messages=self._template_messages(messages, marked),
                add_generation_prompt=gen,
                **extra,
                **self._specials,
            )
        except TemplateError as e:
            raise RowError(
                "chat template", f"the directory's chat_template refused the conversation: {e}"
            ) from None

    def _render_text(self, messages: Sequence[Mapping[str, Any]], gen: bool, check: bool = True) -> str:
        """The render with sentinels, checked: each sentinel at most once and in order, and (with
        `check`) the text filled in equals the template's render of the real text."""
        text = self._jinja_render(messages, gen, marked=True)
        found = [int(i) for i in _SENTINEL.findall(text)]
        in_order = [n // 2 for n in found] == sorted(n // 2 for n in found)  # thinking precedes content
        # Every message's content is shown; only thoughts may be left out (Qwen3 drops old ones).
        shown = {2 * k for k, m in enumerate(messages) if m.get("content")} <= set(found)
        faithful = not check or _fill(text, messages) == self._jinja_render(messages, gen, marked=False)
        if len(set(found)) != len(found) or not in_order or not shown or not faithful:
            raise RowError(
                "chat template",
                "the directory's chat_template transforms message text (drops, strips, rewrites or "
                "repeats it); it cannot be used for training",
            )
        return text

    def _turn_span(self, messages: Sequence[Mapping[str, Any]], k: int) -> tuple[int, int, str]:
        """Assistant turn k in its own render context: (length and hash of the prompt inference
        feeds, what the turn adds after it up to its end token), in sentinel text.

        Remembered per conversation prefix: the pipeline asks `contexts` first and renders the
        examples later, and the three renders per turn are most of the hf template's cost (the
        prompt is kept as its hash only: it is the whole conversation so far)."""
        key = _prefix_key(messages, k + 1)
        hit = self._spans.get(key)
        if hit is None:
            if len(self._spans) >= 1 << 16:  # many chunks of rows (the pipeline encodes 256 at a time)
                self._spans.clear()
            prompt, completion = self._compute_turn_span(messages, k)
            hit = self._spans[key] = (len(prompt), hash(prompt), completion)
        return hit

    @staticmethod
    def _fits(text: str, span: tuple[int, int, str]) -> bool:
        """Whether `text` renders the turn of `span` as its own context does: the same prompt
        before it, the same completion."""
        n, digest, completion = span
        return text[n : n + len(completion)] == completion and hash(text[:n]) == digest

    def _compute_turn_span(self, messages: Sequence[Mapping[str, Any]], k: int) -> tuple[str, str]:
        # The prompt is the start of `upto`, whose real text is checked: no second check for it.
        prompt = self._render_text(messages[:k], True, check=False)
        upto = self._render_text(messages[: k + 1], False)
        if not upto.startswith(prompt):
            if self.enable_thinking is False and messages[k].get("reasoning_content"):
                raise RowError("reasoning", f"message {k} has reasoning_content but enable_thinking is false")
            raise RowError(
                "chat template",
                f"message {k}: rendering the conversation up to it does not start with the prompt "
                "add_generation_prompt renders before it",
            )
        end = upto.find(self._end_text, len(prompt))
        if end < 0:
            raise RowError("chat template", f"message {k}: no {self._end_text!r} ends the turn")
        completion = upto[len(prompt) : end + len(self._end_text)]
        for f, field in enumerate(_FIELDS):
            if messages[k].get(field) and f"\ue000{2 * k + f}\ue001" not in completion:
                raise RowError(
                    "chat template",
                    f"message {k}: the directory's chat_template drops its {field} (trained turn)",
                )
        return prompt, completion

    def _trained(self, messages: list[dict[str, Any]], train: frozenset[str] | None) -> list[int]:
        cats = assistant_categories(messages)
        return [k for k, m in enumerate(messages) if self._bit(train, cats[k], m)]

    # ------------------------------------------------------------------ contexts and parts
    def contexts(
        self, messages: Sequence[Mapping[str, Any]], loss_on: Collection[str] = DEFAULT_LOSS_ON
    ) -> list[list[dict[str, Any]]]:
        msgs = validate_messages(messages)
        self._shown.clear()
        train = check_loss_on(loss_on)
        trained = self._trained(msgs, train)
        if not trained:
            return [msgs]
        spans = {k: self._turn_span(msgs, k) for k in trained}
        if all(self._fits(self._render_text(msgs, False), spans[k]) for k in trained):
            return [msgs]  # append-only here: one example, as always
        # Greedy: a group of trained turns shares an example while each turn's own context and
        # completion are a prefix of the render up to the group's last turn.
        groups: list[list[int]] = []
        for k in trained:
            if groups:
                text = self._render_text(msgs[: k + 1], False)
                if all(self._fits(text, spans[j]) for j in (*groups[-1], k)):
                    groups[-1].append(k)
                    continue
            groups.append([k])
        out = []
        start = 0  # messages before it are context in this example (trained in an earlier one)
        for group in groups:
            end = group[-1] + 1
            out.append([{**m, "_context": True} if j < start and m["role"] == "assistant" else m
                        for j, m in enumerate(msgs[:end])])  # fmt: skip
            start = end
        return out

    def _render(
        self, messages: list[dict[str, Any]], train: frozenset[str] | None, gen: bool = False
    ) -> list[Part]:
        for i, m in enumerate(messages):
            if any(ch in m[f] for f in _FIELDS if m.get(f) for ch in "\ue000\ue001"):
                raise RowError(
                    "chat template", f"message {i} contains the private-use characters U+E000/U+E001"
                )
        self._check_tool_text(messages)
        self._shown.clear()
        text = self._render_text(messages, gen)
        trained = self._trained(messages, train) if not gen else []
        intervals = []
        for k in trained:
            span = self._turn_span(messages, k)
            if not self._fits(text, span):
                raise RowError(
                    "chat template",
                    f"message {k} renders differently later in the conversation (the template is not "
                    "append-only): split it with ChatTemplate.contexts",
                )
            intervals.append((span[0], span[0] + len(span[2]), k))
        ends = self._message_ends(text, messages, intervals)
        cuts = {0, len(text)} | {e for e in ends if e >= 0}
        for a, b, _ in intervals:
            cuts |= {a, b}
        for mt in _SENTINEL.finditer(text):
            cuts |= {mt.start(), mt.end()}
        points = sorted(cuts)
        ending: dict[int, list[int]] = {}
        for k, e in enumerate(ends):
            ending.setdefault(e, []).append(k)
        parts: list[Part] = []
        inside = sorted(intervals)
        for a, b in zip(points, points[1:], strict=False):
            while inside and inside[0][1] <= a:
                inside.pop(0)
            bit = int(bool(inside) and inside[0][0] <= a and b <= inside[0][1])
            seg = text[a:b]
            mt = _SENTINEL.fullmatch(seg)
            if mt:
                n = int(mt.group(1))
                parts.append(("text", [messages[n // 2][_FIELDS[n % 2]]], bit, -1))
            else:
                parts.append(("ids", self._markup(seg), bit, -1))
            parts.extend(("ids", [], 0, k) for k in ending.get(b, ()))
        return parts

    def _message_ends(
        self, text: str, messages: list[dict[str, Any]], intervals: list[tuple[int, int, int]]
    ) -> list[int]:
        """Character position where each message ends in `text` (-1: not found; the token ends are
        then filled forward): a trained turn's completion end, else the end token after its text."""
        exact = {k: b for _, b, k in intervals}
        ends = []
        prev = 0
        for k, m in enumerate(messages):
            if k in exact:
                end = exact[k]
            else:
                marks = [
                    text.find(f"\ue000{2 * k + f}\ue001") for f, field in enumerate(_FIELDS) if m.get(field)
                ]
                marks = [p for p in marks if p >= 0]
                end = -1
                if marks:
                    hit = text.find(self._end_text, max(marks))
                    end = hit + len(self._end_text) if hit >= 0 else -1
            if end >= 0:
                end = max(end, prev)
                prev = end
            ends.append(end)
        return ends

    def _check_tool_text(self, messages: list[dict[str, Any]]) -> None:
        """Tool definitions and calls are the template's markup (encoded with control tokens):
        text in them that spells a control token would become one, so it is refused."""
        blobs = [json.dumps(messages[0].get("tools") or [], ensure_ascii=False)]
        blobs += [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls")]
        for blob in blobs:
            for t in self._control_texts:
                if t in blob:
                    raise RowError(
                        "chat template", f"a tool definition or call contains control-token text {t!r}"
                    )

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The template's own render with add_generation_prompt (and `enable_thinking`), as
        inference feeds it."""
        msgs = _validate_prompt(messages)
        return self._assemble([self._render(msgs, None, gen=True)], [len(msgs)])[0][0]


def _prefix_key(messages: Sequence[Mapping[str, Any]], n: int) -> tuple[Any, ...]:
    """What the template sees of messages[:n], hashable (strings hash once; calls and tools as JSON)."""

    def part(m: Mapping[str, Any]) -> tuple[Any, ...]:
        calls = json.dumps(m["tool_calls"], sort_keys=True) if m.get("tool_calls") else None
        tools = json.dumps(m["tools"], sort_keys=True) if m.get("tools") else None
        return (
            m["role"],
            m["content"],
            m.get("reasoning_content"),
            calls,
            m.get("tool_call_id"),
            m.get("name"),
            tools,
        )

    return tuple(part(m) for m in messages[:n])


def _fill(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    return _SENTINEL.sub(lambda mt: messages[int(mt.group(1)) // 2][_FIELDS[int(mt.group(1)) % 2]], text)


_TEMPLATE_CLASSES = {"llama3": Llama3Template, "mistral": MistralTemplate, "hf": HFDirTemplate}


def get_template(
    name: str, tokenizer: PreTrainedTokenizerBase, enable_thinking: bool | None = None
) -> ChatTemplate:
    """`enable_thinking` (hf only): passed to the directory's template (Qwen3: False renders the
    empty think block into the prompt, and a trained turn may then carry no reasoning)."""
    if name not in _TEMPLATE_CLASSES:
        raise ValueError(f"unknown chat template {name!r}; choose from {TEMPLATES}")
    if name == "hf":
        return HFDirTemplate(tokenizer, enable_thinking=enable_thinking)
    if enable_thinking is not None:
        raise ValueError(f"enable_thinking applies to the hf template only, not {name!r}")
    return _TEMPLATE_CLASSES[name](tokenizer)
