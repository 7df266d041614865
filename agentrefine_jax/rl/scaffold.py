"""The chat template's tokens around a sampled reply, for episodes built by appending ids.

A rollout never re-renders its conversation (re-tokenizing the decoded replies does not give back
the sampled ids: verl #3477/#6501). It is the template's render of the first prompt, then per turn
the sampled ids and the template's tokens from the end of that assistant turn to the next
generation prompt, which `Scaffold` takes from the template itself:

* `end_ids`: what closes an assistant turn (Llama-3 `<|eot_id|>`, ChatML `<|im_end|>`), appended
  when the model did not sample a stop token itself (its turn was cut by a stop string or by
  max_new_tokens);
* `observation(message)`: everything after the end token through the next generation prompt
  (ChatML `\\n<|im_start|>user\\nOBS<|im_end|>\\n<|im_start|>assistant\\n`; Llama-3 the user header,
  OBS, `<|eot_id|>`, the assistant header).

Both come from rendering a fixed probe conversation (system, user, assistant) and the same with
the new observation turn: the tokens the render adds are the delta. That is exact for append-only
templates - a message's tokens depend only on its role and text, and a longer conversation's
render starts with the shorter one's - which Llama-3's (Meta's ChatFormat) and ChatML's are; the
render of each message's text is the template's own plain-text encoding in both, so the delta is
token for token what a render of the whole conversation holds there (tests/test_rl_rollout.py
checks it against that render). A template that is not append-only (Qwen3 drops earlier thoughts
and adds an empty think block to the last turn) fails the probe's prefix checks and is refused in
one line: its episodes have no single token sequence that is both what the policy saw and what
the template would show it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_PROBE = [
    {"role": "system", "content": "System."},
    {"role": "user", "content": "Observation."},
]
_REPLY = {"role": "assistant", "content": "Action."}


class NotAppendOnlyError(ValueError):
    """The template renders an earlier turn differently once later turns follow."""


class Scaffold:
    """The template tokens an appended episode needs (module docstring)."""

    def __init__(self, template: Any):
        self.template = template
        name = getattr(template, "name", type(template).__name__)
        refuse = (
            f"chat template {name!r} is not append-only (a turn renders differently once later turns "
            "follow): multi-turn rollouts need one (llama3, or an hf ChatML template)"
        )
        prompt = template.encode_prompt(_PROBE)
        ids, mask = template.encode([*_PROBE, _REPLY])
        content = template.encode_text([_REPLY["content"]])[0]
        turn, bits = ids[len(prompt) :], mask[len(prompt) :]
        trained = [i for i, b in enumerate(bits) if b]
        # The assistant turn must continue the generation prompt with the reply's own text first (a
        # template that adds e.g. an empty think block before it changes the policy's context).
        if ids[: len(prompt)] != prompt or not trained or trained[0] != 0 or turn[: len(content)] != content:
            raise NotAppendOnlyError(refuse)
        self.end_ids: tuple[int, ...] = tuple(turn[len(content) : trained[-1] + 1])
        self.after_end: tuple[int, ...] = tuple(turn[trained[-1] + 1 :])  # ChatML's "\n"
        if not self.end_ids:
            raise NotAppendOnlyError(f"chat template {name!r}: no end-of-turn token after a reply")
        self._closed = list(ids)  # probe conversation ending with the assistant turn
        self._refuse = refuse

    def first_prompt(self, messages: list[Mapping[str, Any]]) -> list[int]:
        """The template's render of the episode's first prompt (system, first observation) with the
        generation prompt."""
        return self.template.encode_prompt(messages)

    def observation(self, message: Mapping[str, Any]) -> list[int]:
        """The tokens after an assistant turn's end token up to and including the next generation
        prompt, with `message` (the environment's user turn) in between."""
        after = self.template.encode_prompt([*_PROBE, _REPLY, dict(message)])
        if after[: len(self._closed)] != self._closed:
            raise NotAppendOnlyError(self._refuse)
        return [*self.after_end, *after[len(self._closed) :]]
