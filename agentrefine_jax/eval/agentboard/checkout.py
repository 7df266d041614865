"""Read files from the user's AgentBoard checkout, never importing or executing its code.

The user brings the checkout (code Apache-2.0, data GPL); we read its prompt JSONs, `data/<task>/test.jsonl`,
PDDL files and eval config at run time. A missing file is a one-line `CheckoutError` naming the path and the
AgentBoard download that provides it.
"""

from __future__ import annotations

import ast
import json
import pathlib
from typing import Any

CONFIG_FILE = "eval_configs/main_results_all_tasks.yaml"

# What provides which part of a checkout (AgentBoard's README): the git clone holds code, prompts, configs and
# the bundled pddlgym PDDL files; `data/` comes from its data.tar.gz (HF dataset hkust-nlp/agentboard).
CLONE = "the AgentBoard repository (git clone https://github.com/hkust-nlp/AgentBoard)"
DATA = "AgentBoard's data download (data.tar.gz of the HF dataset hkust-nlp/agentboard, unpacked as data/)"


class CheckoutError(ValueError):
    """A file the protocol needs is absent or unreadable; the message is one line."""


class Checkout:
    """An AgentBoard checkout rooted at `root` (its data in `root/data`)."""

    def __init__(self, root: str | pathlib.Path):
        self.root = pathlib.Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise CheckoutError(f"AgentBoard checkout {self.root} is not a directory; provided by {CLONE}")
        self._config: dict | None = None

    def path(self, rel: str, provides: str) -> pathlib.Path:
        """`root/rel`, which must exist; `provides` names the download that holds it (e.g. `DATA`)."""
        p = self.root / rel
        if not p.exists():
            raise CheckoutError(f"missing {p}: provided by {provides}")
        return p

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def _provider(self, rel: str) -> str:
        return DATA if rel.startswith("data/") else CLONE

    def read_text(self, rel: str, provides: str | None = None) -> str:
        p = self.path(rel, provides or self._provider(rel))
        try:
            return p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckoutError(f"cannot read {p}: {e}") from None

    def read_json(self, rel: str, provides: str | None = None) -> Any:
        text = self.read_text(rel, provides)
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckoutError(f"{self.root / rel}: not valid JSON ({e})") from None

    def read_jsonl(self, rel: str, provides: str | None = None) -> list[dict]:
        rows = []
        for n, line in enumerate(self.read_text(rel, provides).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CheckoutError(f"{self.root / rel}:{n}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise CheckoutError(f"{self.root / rel}:{n}: expected a JSON object")
            rows.append(row)
        return rows

    def has_config(self) -> bool:
        return self.exists(CONFIG_FILE)

    def config(self) -> dict:
        """The parsed eval config (`eval_configs/main_results_all_tasks.yaml`)."""
        if self._config is None:
            import yaml  # PyYAML: a dependency of transformers/flax, always present

            text = self.read_text(CONFIG_FILE, CLONE)
            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise CheckoutError(f"{self.root / CONFIG_FILE}: not valid YAML ({first})") from None
            if not isinstance(doc, dict):
                raise CheckoutError(f"{self.root / CONFIG_FILE}: expected a mapping at top level")
            self._config = doc
        return self._config

    def env_config(self, task: str) -> dict:
        """CFG `env.<task>` (empty when the config has no such section)."""
        env = self.config().get("env") or {}
        section = env.get(task) or {}
        if not isinstance(section, dict):
            raise CheckoutError(f"{self.root / CONFIG_FILE}: env.{task} is not a mapping")
        return section

    def literal(self, rel_py_file: str, name: str) -> Any:
        """A top-level `name = <literal>` of a Python file, read with `ast.literal_eval` (never imported)."""
        p = self.path(rel_py_file, CLONE)
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            raise CheckoutError(f"cannot parse {p}: {e}") from None
        for node in tree.body:
            targets: list[ast.expr] = []
            value = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                try:
                    return ast.literal_eval(value)
                except ValueError:
                    raise CheckoutError(f"{p}: `{name}` is not a plain literal") from None
        raise CheckoutError(f"{p}: no top-level `{name} = ...`")
