"""Persona files: plain text (one persona a line) or JSONL, including Persona Hub's layouts.

Persona Hub (proj-persona/PersonaHub) stores `{"persona": ...}` in persona.jsonl and
`{"input persona": ..., "synthesized text": ...}` in its task subsets; both are read, as is an
optional `id`.  Without an id, a persona's id is a hash of its text, so the same persona file
gives the same ids on every run (resume depends on it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re

PERSONA_KEYS = ("persona", "input persona", "input_persona", "text")
PACKAGED = pathlib.Path(__file__).with_name("personas.jsonl")
_ID_OK = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


@dataclasses.dataclass(frozen=True)
class Persona:
    id: str
    text: str


@dataclasses.dataclass
class PersonaLoad:
    personas: list[Persona]
    skipped: dict[str, int]  # reason -> count (bad lines, duplicates)


def persona_id(text: str) -> str:
    return "p-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def load_personas(path: str | pathlib.Path) -> PersonaLoad:
    """Read personas; unusable lines are skipped and counted, never silently dropped."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"persona file not found: {p}")
    as_jsonl = p.suffix in (".jsonl", ".json")
    personas: list[Persona] = []
    skipped: dict[str, int] = {}
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    with open(p, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            pid = None
            if as_jsonl:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    skip("invalid_json")
                    continue
                text = next((obj[k] for k in PERSONA_KEYS if isinstance(obj, dict) and k in obj), None)
                if not isinstance(text, str):
                    skip("no_persona_field")
                    continue
                raw_id = obj.get("id")
                if raw_id is not None:
                    pid = str(raw_id)
                    if not _ID_OK.match(pid):  # ids become file names of the resume state
                        skip("bad_id")
                        continue
            else:
                text = line
            text = text.strip()
            if not text:
                skip("empty_persona")
                continue
            pid = pid or persona_id(text)
            if pid in seen_ids or (text in seen_texts):
                skip("duplicate")
                continue
            seen_ids.add(pid)
            seen_texts.add(text)
            personas.append(Persona(pid, text))
    return PersonaLoad(personas, skipped)
