"""A GRPO run's rollout journal: each phase's episodes, written to the run directory before the
phase's first optimizer step, so a run killed inside a phase resumes on exactly those episodes.

Why a journal rather than playing the phase again: the episodes were sampled with the parameters
the phase started from, which a checkpoint inside the phase (train.checkpoint_every not a multiple
of rl.updates_per_phase) no longer holds; and playing them is the slow part of a phase. Replaying
from (rl.seed, phase) would also tie a resume to the sampler giving bit-identical tokens in a new
process. The journal makes a mid-phase resume depend only on what was written.

`<run_dir>/rollouts/phase_000003.jsonl`: a header line (the phase, how many episodes, how long
they took to play, and the `rl` settings that made them), then one `Rollout` per line. Written
whole to a temporary sibling and renamed into place (an object store writes an object whole), so
a phase's file is either complete or absent; JSON's float text round-trips every log-probability
exactly. Journals no retained checkpoint can resume into are deleted (`prune`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

from agentrefine_jax import outputs
from agentrefine_jax.config import RLConfig, to_dict
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path, is_url
from agentrefine_jax.rl.batch import Rollout
from agentrefine_jax.train.run_dir import TrainingError

log = logging.getLogger("agentrefine_jax.rl")

SUBDIR = "rollouts"
_NAME = re.compile(r"^phase_(\d+)\.jsonl$")


class JournalError(TrainingError):
    """A phase's journal that cannot be used (unreadable, or made under other rl settings)."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """A phase's episodes as played (or read back) and the seconds playing them took."""

    rollouts: list[Rollout]
    seconds: float


class RolloutJournal:
    """The journal of one run directory; `settings` (the run's `rl` section) must match a read
    journal's header."""

    def __init__(self, run_dir: Any, settings: RLConfig) -> None:
        self.root: epath.Path = as_path(run_dir) / SUBDIR
        self.settings = to_dict(settings)

    def path(self, phase: int) -> epath.Path:
        return self.root / f"phase_{phase:06d}.jsonl"

    def write(self, phase: int, played: Phase) -> None:
        header = {
            "phase": phase,
            "rollouts": len(played.rollouts),
            "seconds": played.seconds,
            "rl": self.settings,
        }
        lines = [json_dumps(header)]
        lines += [json_dumps(_plain(dataclasses.asdict(r))) for r in played.rollouts]
        text = "".join(line + "\n" for line in lines)
        target = self.path(phase)
        if is_url(target):
            self.root.mkdir(parents=True, exist_ok=True)
            target.write_text(text)  # an object is stored whole or not at all
        else:
            outputs.write_text(target, text)  # temporary sibling, fsync, rename

    def read(self, phase: int) -> Phase | None:
        """The phase's journaled episodes, or None when it has no journal."""
        target = self.path(phase)
        if not target.exists():
            return None
        try:
            lines = target.read_text().splitlines()
            header = json.loads(lines[0])
            rollouts = [_rollout(json.loads(line)) for line in lines[1:]]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise JournalError(f"rollout journal {target} is unreadable ({type(e).__name__}: {e})") from None
        if header.get("phase") != phase or header.get("rollouts") != len(rollouts):
            raise JournalError(
                f"rollout journal {target} is incomplete: its header says phase {header.get('phase')} with "
                f"{header.get('rollouts')} episodes, it holds {len(rollouts)}"
            )
        if header.get("rl") != self.settings:
            changed = sorted(k for k in self.settings if (header.get("rl") or {}).get(k) != self.settings[k])
            raise JournalError(
                f"rollout journal {target} was played under other rl settings ({', '.join(changed)}); "
                "resuming would mix two runs. Use a new train.run_dir or restore the original settings."
            )
        return Phase(rollouts, float(header["seconds"]))

    def phases(self) -> list[int]:
        if not self.root.exists():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _NAME.match(p.name)))

    def prune(self, keep: Iterable[int]) -> None:
        """Delete the journals of every phase not in `keep` (the phases that the retained
        checkpoints, and the phase under way, resume into)."""
        wanted = set(keep)
        for phase in self.phases():
            if phase not in wanted:
                self.path(phase).unlink(missing_ok=True)


def _plain(v: Any) -> Any:
    """JSON's types for a rollout's fields (numpy scalars as Python numbers: exact for floats)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v.item() if isinstance(v, np.generic) else v


def _rollout(d: dict[str, Any]) -> Rollout:
    """A journal line back into a Rollout (the tuples JSON turned into lists)."""
    fields = {f.name for f in dataclasses.fields(Rollout)}
    if set(d) != fields:
        raise KeyError(f"fields {sorted(set(d) ^ fields)}")
    tuples = {k: tuple(v) for k, v in d.items() if isinstance(v, list)}
    return Rollout(**{**d, **tuples})


def keep_phases(checkpoint_steps: Sequence[int], updates_per_phase: int, current: int) -> set[int]:
    """The phases whose journals a resume may still read: each retained checkpoint's (a checkpoint
    at step s resumes inside, or at the start of, phase s // updates_per_phase) and `current`."""
    return {s // updates_per_phase for s in checkpoint_steps} | {current}
