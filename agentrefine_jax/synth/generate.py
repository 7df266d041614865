"""The synthesis pipeline: persona -> script -> DM/Player trajectory -> Algorithm 1 -> retry.

Output directory:
- trajectories.jsonl  verified raw trajectories (+ "meta": attempts, usage, history)
- failed.jsonl        personas that exhausted their retries (reason, last attempt kept)
- state/<id>.json     in-flight work: script, verified prefix, attempts, usage
- summary.json        counts and token usage of the latest run

Nothing is lost on a crash or Ctrl-C: finished personas are appended with one fsynced write
and their state file removed afterwards; in-flight state is replaced atomically after every
LLM call.  A restart skips ids present in trajectories.jsonl / failed.jsonl (so nothing is
duplicated, even if the kill fell between the append and the state removal) and resumes the
rest from their saved script and verified prefix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import queue
import re
import shutil
import sys
import threading
import time
from typing import Any

from agentrefine_jax import outputs
from agentrefine_jax.cli_errors import INTERRUPTED, TERMINATED, Terminated
from agentrefine_jax.synth import jsonl, out_dir, prompts
from agentrefine_jax.synth.llm import (
    APIFatalError,
    APITransientError,
    ChatClient,
    JSONExtractError,
    LLMSettings,
    Usage,
    extract_json,
)
from agentrefine_jax.synth.personas import Persona, load_personas
from agentrefine_jax.synth.progress import Progress
from agentrefine_jax.synth.verify import NO_ERROR, verify_trajectory

RESULTS = "trajectories.jsonl"
FAILED = "failed.jsonl"
STATE_DIR = "state"
SUMMARY = "summary.json"
# Everything generate writes in --out (out_dir adopts a pre-marker directory holding only these).
OWN = frozenset({RESULTS, FAILED, STATE_DIR, SUMMARY, out_dir.MARKER})

MALFORMED_REPLY = "malformed_reply"
INVALID_SCRIPT = "invalid_script"

_TEMPLATE = re.compile(r"[^{}]*(\{[^{}]+\}[^{}]*)*")


@dataclasses.dataclass
class GenerateConfig:
    personas: pathlib.Path
    out_dir: pathlib.Path
    script_llm: LLMSettings
    trajectory_llm: LLMSettings
    concurrency: int = 4
    # Regenerations allowed after the first attempt (per stage: script, trajectory).
    max_retries: int = 3
    limit: int | None = None
    progress_interval: float = 5.0


@dataclasses.dataclass
class GenerateReport:
    total: int = 0
    done_before: int = 0
    resumed: int = 0
    succeeded: int = 0
    failed: int = 0
    unfinished: int = 0
    fatal: str | None = None
    write_error: str | None = None  # an output file could not be written (disk full): exit 1
    interrupted: bool = False
    terminated: bool = False  # SIGTERM rather than Ctrl-C: exit 75
    usage: Usage = dataclasses.field(default_factory=Usage)
    persona_skips: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.terminated:
            return TERMINATED
        if self.interrupted:
            return INTERRUPTED
        if self.fatal:
            return 2
        return 1 if self.unfinished or self.write_error else 0


class ScriptError(ValueError):
    pass


# ------------------------------------------------------------------ reply parsing


def parse_script(value: Any) -> dict[str, Any]:
    """Validate a script reply; store templates as strings and their descriptions aside."""
    if not isinstance(value, dict):
        raise ScriptError(f"script is {type(value).__name__}, expected an object")
    for key in ("environment", "task"):
        if not isinstance(value.get(key), str) or not value[key].strip():
            raise ScriptError(f"script.{key} must be a non-empty string")
    items = value.get("available_actions")
    if not isinstance(items, list) or not items:
        raise ScriptError("script.available_actions must be a non-empty list")
    templates: list[str] = []
    descriptions: dict[str, str] = {}
    for item in items:
        if isinstance(item, str):
            template, desc = item, ""
        elif isinstance(item, dict) and isinstance(item.get("action"), str):
            template, desc = item["action"], str(item.get("description") or "")
        else:
            raise ScriptError(f"available action {item!r} has no 'action' template")
        template = template.strip()
        if not template or not _TEMPLATE.fullmatch(template):
            raise ScriptError(f"action template {template!r} is empty or has unbalanced braces")
        if template in descriptions or template in templates:
            continue  # duplicate listing: keep the first
        templates.append(template)
        if desc.strip():
            descriptions[template] = desc.strip()
    script: dict[str, Any] = {
        "environment": value["environment"].strip(),
        "task": value["task"].strip(),
        "available_actions": templates,
    }
    if descriptions:
        script["action_descriptions"] = descriptions
    return script


def parse_turns(value: Any, prefix: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """New turns from a trajectory reply ({"turns": [...]} or a bare list).

    A continuation that repeats the verified prefix is accepted: the repeat is stripped.
    """
    turns = value.get("turns") if isinstance(value, dict) else value
    if not isinstance(turns, list) or not turns:
        raise ValueError('reply is not {"turns": [...]} with at least one turn')
    if prefix and turns[: len(prefix)] == prefix:
        turns = turns[len(prefix) :]
        if not turns:
            raise ValueError("reply only repeats the accepted turns")
    if prefix and isinstance(turns[0], dict):
        # Turns alternate, so a continuation that starts with the role that ended the prefix is
        # a restatement from the start (or a lost turn): splicing it would duplicate content.
        last, first = prefix[-1].get("role"), turns[0].get("role")
        if first == last:
            raise ValueError(f"continuation starts with a {first} turn right after a {last} turn")
    return turns


# ------------------------------------------------------------------ the run


class _Stop(Exception):
    pass


class _WriteFailed(Exception):
    """An output file of the run could not be written (disk full...): the run stops, exit 1."""


def _reason(e: BaseException) -> str:
    if isinstance(e, outputs.OutputWriteError):
        e = e.error
    return (e.strerror if isinstance(e, OSError) and e.strerror else None) or str(e)


class Generator:
    def __init__(self, cfg: GenerateConfig, *, progress_stream=None):
        self.cfg = cfg
        self.out = pathlib.Path(cfg.out_dir)
        self.state_dir = self.out / STATE_DIR
        self.results_path = self.out / RESULTS
        self.failed_path = self.out / FAILED
        self._progress_stream = progress_stream
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self.report = GenerateReport()
        self.progress: Progress | None = None
        # Finished rows whose output file could not take them (a full disk): one directory per run.
        self._rescue_dir: pathlib.Path | None = None
        self._rescued: dict[str, int] = {}
        self._rescue_lost = 0
        self._rescue_elsewhere: list[str] = []

    # -- logging goes through the progress line so the two never interleave
    def log(self, msg: str) -> None:
        if self.progress is not None:
            self.progress.log(msg)
        else:
            stream = self._progress_stream or sys.stderr  # the CLI's progress sink (devnull under -q)
            stream.write(f"{msg}\n")
            stream.flush()

    def _state_path(self, pid: str) -> pathlib.Path:
        return self.state_dir / f"{pid}.json"

    def _save_state(self, state: dict[str, Any]) -> None:
        path = self._state_path(state["id"])
        try:
            jsonl.write_json_atomic(path, state)
        except (OSError, outputs.OutputWriteError) as e:
            with self._write_lock:
                self._adopt(getattr(e, "rescued", None), f"{STATE_DIR}/{path.name}")
            raise _WriteFailed(f"could not write {path}: {_reason(e)}") from e

    def _finish(self, state: dict[str, Any], record: dict[str, Any], ok: bool) -> None:
        with self._write_lock:
            path = self.results_path if ok else self.failed_path
            try:
                jsonl.append_record(path, record)
            except OSError as e:
                # The persona is finished (and paid for): keep its row where it can be found.
                self._rescue_row(path.name, record)
                raise _WriteFailed(f"could not write {path}: {_reason(e)}") from e
            # After the append: a kill in between leaves a stale state file that the next
            # start removes because the id is already finished.
            self._state_path(state["id"]).unlink(missing_ok=True)
            if ok:
                self.report.succeeded += 1
            else:
                self.report.failed += 1

    def _rescue_row(self, name: str, record: dict[str, Any]) -> None:
        """Append a finished row its output file could not take to this run's one rescue directory
        under $TMPDIR (`agentrefine-rescued-*/trajectories.jsonl` or `failed.jsonl`); the run's last
        line says where and how many (`_rescue_note`). Caller holds the write lock."""
        try:
            if self._rescue_dir is None:
                self._rescue_dir = outputs.rescue_location()
            jsonl.append_record(self._rescue_dir / name, record)
            self._rescued[name] = self._rescued.get(name, 0) + 1
        except OSError:  # $TMPDIR is full too: its state file stays, a rerun finishes it again
            self._rescue_lost += 1

    def _adopt(self, kept: pathlib.Path | None, rel: str) -> None:
        """Move a file `outputs` rescued on its own (a state file, the summary) into this run's rescue
        directory as `rel`, so the final line names one place. Caller holds the write lock."""
        if kept is None:
            return
        try:
            if self._rescue_dir is None:
                self._rescue_dir = outputs.rescue_location()
            target = self._rescue_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(kept, target)
            kept.parent.rmdir()
        except OSError:
            self._rescue_elsewhere.append(str(kept))  # it stays where outputs put it: named as is
            return
        key = rel.split("/")[0]
        self._rescued[key] = self._rescued.get(key, 0) + 1

    def _rescue_note(self) -> str:
        """What the final error line adds: where the rows that could not be appended went."""
        note = ""
        if self._rescued:
            counts = {
                RESULTS: "finished row(s)",
                FAILED: "failed-persona row(s)",
                STATE_DIR: "state file(s) of unfinished personas",
                SUMMARY: "run summary",
            }
            what = ", ".join(
                f"{n} {counts[name]} ({name})" if name != SUMMARY else f"the {counts[name]} ({name})"
                for name, n in sorted(self._rescued.items())
            )
            note += f"; kept instead in {self._rescue_dir}: {what}"
        if self._rescue_elsewhere:
            note += f"; also kept in {', '.join(self._rescue_elsewhere)}"
        if self._rescue_lost:
            note += (
                f"; {self._rescue_lost} finished row(s) could not be kept there either (their state "
                "is kept: a rerun finishes them again)"
            )
        return note

    # -- one persona
    def _call(self, client: ChatClient, messages: list[dict[str, str]], state: dict[str, Any], tag: str):
        if self._stop.is_set():
            raise _Stop
        reply = client.complete(messages, tag=f"{state['id']} {tag}: ")
        usage = Usage.from_dict(state["usage"])
        usage.add(reply.usage)
        state["usage"] = usage.as_dict()
        assert self.progress is not None
        self.progress.update(tokens=reply.usage.total_tokens)
        return reply

    def synthesize(self, persona: Persona, state: dict[str, Any]) -> None:
        cfg = self.cfg
        pid = persona.id
        assert self.progress is not None
        while state["script"] is None:
            if state["script_attempts"] > cfg.max_retries:
                self._fail(state, INVALID_SCRIPT, state["last_detail"])
                return
            reply = self._call(self.script_client, prompts.script_messages(persona.text), state, "script")
            state["script_attempts"] += 1
            try:
                state["script"] = parse_script(extract_json(reply.text))
            except (JSONExtractError, ScriptError) as e:
                state["last_reason"], state["last_detail"] = INVALID_SCRIPT, str(e)
                self.log(f"[synth] {pid}: script attempt {state['script_attempts']} unusable: {e}")
            self._save_state(state)

        while True:
            if state["attempts"] > cfg.max_retries:
                self._fail(state, state["last_reason"], state["last_detail"])
                return
            prefix = state["prefix"]
            if prefix:
                msgs = prompts.continue_messages(
                    persona.text, state["script"], prefix, f"{state['last_reason']}: {state['last_detail']}"
                )
            else:
                msgs = prompts.trajectory_messages(persona.text, state["script"])
            if state["attempts"] > 0:
                self.progress.update(retrying=pid)
            tag = f"trajectory attempt {state['attempts'] + 1}"
            reply = self._call(self.trajectory_client, msgs, state, tag)
            state["attempts"] += 1
            entry: dict[str, Any] = {
                "attempt": state["attempts"],
                "prefix_turns": len(prefix),
                "resumes": state["resumes"],
            }
            try:
                new_turns = parse_turns(extract_json(reply.text), prefix)
            except (JSONExtractError, ValueError) as e:
                entry.update(reason=MALFORMED_REPLY, verified_turns=len(prefix))
                state["history"].append(entry)
                state["last_reason"], state["last_detail"] = MALFORMED_REPLY, str(e)
                state["last_turns"] = None
                self.log(f"[synth] {pid}: attempt {state['attempts']}: {MALFORMED_REPLY}: {e}")
                self._save_state(state)
                continue
            raw = {"id": pid, "persona": persona.text, "script": state["script"], "turns": prefix + new_turns}
            result = verify_trajectory(raw)
            entry.update(reason=result.reason, verified_turns=result.verified_turns)
            state["history"].append(entry)
            if result.ok:
                raw["meta"] = self._meta(state)
                self._finish(state, raw, ok=True)
                self.progress.update(done=1, settled=pid)
                return
            # Paper, Algorithm 1 note: a trajectory with no error at all restarts from scratch.
            state["prefix"] = [] if result.reason == NO_ERROR else raw["turns"][: result.verified_turns]
            state["last_reason"], state["last_detail"] = result.reason, result.detail
            state["last_turns"] = raw["turns"]
            nxt = (
                f"regenerating from {len(state['prefix'])} verified turns"
                if state["attempts"] <= cfg.max_retries
                else "no retries left"
            )
            self.log(f"[synth] {pid}: attempt {state['attempts']} failed Algorithm 1: {result.detail}; {nxt}")
            self._save_state(state)

    def _meta(self, state: dict[str, Any]) -> dict[str, Any]:
        return {
            "script_model": self.cfg.script_llm.model,
            "model": self.cfg.trajectory_llm.model,
            "script_attempts": state["script_attempts"],
            "attempts": state["attempts"],
            "resumes": state["resumes"],
            "history": state["history"],
            "usage": state["usage"],
        }

    def _fail(self, state: dict[str, Any], reason: str, detail: str) -> None:
        record = {
            "id": state["id"],
            "persona": state["persona"],
            "reason": reason,
            "detail": detail,
            "script": state["script"],
            "verified_turns": state["history"][-1]["verified_turns"] if state["history"] else 0,
            "last_turns": state.get("last_turns"),
            "meta": self._meta(state),
        }
        self._finish(state, record, ok=False)
        assert self.progress is not None
        self.progress.update(failed=1, settled=state["id"])
        self.log(f"[synth] {state['id']}: gave up after {state['attempts']} attempt(s): {reason}: {detail}")

    # -- setup and the worker pool
    def _new_state(self, persona: Persona) -> dict[str, Any]:
        return {
            "id": persona.id,
            "persona": persona.text,
            "script": None,
            "script_attempts": 0,
            "prefix": [],
            "attempts": 0,
            "last_reason": "",
            "last_detail": "",
            "last_turns": None,
            "history": [],
            "usage": Usage().as_dict(),
            "resumes": 0,
        }

    def _load_state(self, persona: Persona) -> dict[str, Any] | None:
        path = self._state_path(persona.id)
        if not path.exists():
            return None
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            self.log(f"[synth] warning: unreadable state {path} ({e}); restarting {persona.id} from scratch")
            return None
        if state.get("persona") != persona.text:
            self.log(f"[synth] warning: {path} belongs to a different persona text; restarting {persona.id}")
            return None
        state["resumes"] = int(state.get("resumes", 0)) + 1
        return state

    def _finished_ids(self) -> set[str]:
        ids: set[str] = set()
        for path in (self.results_path, self.failed_path):
            records, torn, corrupt, completed = jsonl.read_records(path, complete=True)
            if torn:
                self.log(f"[synth] repaired {path.name}: removed a torn last line left by a crash")
            elif completed:
                self.log(f"[synth] {path.name}: its last row had no final newline; added one (row kept)")
            if corrupt:
                self.log(f"[synth] warning: {path.name} has {corrupt} unparseable line(s); they are ignored")
            for r in records:
                rid = r.get("id")
                if rid in ids:
                    self.log(f"[synth] warning: id {rid!r} appears more than once in the output")
                ids.add(rid)
        return ids

    def run(self) -> GenerateReport:
        loaded = load_personas(self.cfg.personas)  # a missing persona file: nothing created
        with out_dir.hold(self.out, OWN):
            return self._run(loaded)

    def _run(self, loaded: Any) -> GenerateReport:
        cfg = self.cfg
        self.state_dir.mkdir(parents=True, exist_ok=True)
        personas = loaded.personas[: cfg.limit] if cfg.limit else loaded.personas
        self.report.total = len(personas)
        self.report.persona_skips = loaded.skipped
        if loaded.skipped:
            n = sum(loaded.skipped.values())
            self.log(f"[synth] persona file: skipped {n} line(s): {loaded.skipped}")
        finished = self._finished_ids()
        work: list[tuple[Persona, dict[str, Any]]] = []
        for p in personas:
            if p.id in finished:
                self.report.done_before += 1
                self._state_path(p.id).unlink(missing_ok=True)
                continue
            state = self._load_state(p)
            if state is not None:
                self.report.resumed += 1
            work.append((p, state or self._new_state(p)))
        known = {p.id for p in personas}
        orphans = [f.name for f in self.state_dir.glob("*.json") if f.stem not in known]
        if orphans:
            self.log(
                f"[synth] note: {len(orphans)} state file(s) belong to personas outside this persona "
                f"file (or beyond --limit) and are left untouched: {orphans[:5]}"
            )
        self.log(
            f"[synth] {len(personas)} personas: {self.report.done_before} already finished, "
            f"{self.report.resumed} resuming in-flight, {len(work) - self.report.resumed} new; "
            f"out={self.out}"
        )
        self.script_client = ChatClient(cfg.script_llm, log=self.log)
        same = cfg.script_llm == cfg.trajectory_llm
        self.trajectory_client = self.script_client if same else ChatClient(cfg.trajectory_llm, log=self.log)
        self.progress = Progress(
            len(personas),
            already_done=self.report.done_before,
            stream=self._progress_stream,
            interval=cfg.progress_interval,
        )
        self._pool(work)
        self.progress.close()
        self.report.unfinished = len(work) - self.report.succeeded - self.report.failed
        usage = Usage()
        usage.add(self.script_client.usage)
        if self.trajectory_client is not self.script_client:
            usage.add(self.trajectory_client.usage)
        self.report.usage = usage
        try:
            self._write_summary()
        except (OSError, outputs.OutputWriteError) as e:
            with self._write_lock:
                self._adopt(getattr(e, "rescued", None), SUMMARY)
            if not self.report.write_error:
                self.report.write_error = f"could not write {self.out / SUMMARY}: {_reason(e)}"
        if self.report.write_error:
            self.report.write_error += self._rescue_note()
        return self.report

    def _pool(self, work: list[tuple[Persona, dict[str, Any]]]) -> None:
        """Synthesize `work` on `concurrency` threads; returns when all settled, on a stop, or
        on Ctrl-C / SIGTERM (recorded in the report; saved state covers requests in the air)."""
        cfg = self.cfg
        assert self.progress is not None
        todo: queue.Queue[tuple[Persona, dict[str, Any]]] = queue.Queue()
        for item in work:
            todo.put(item)
        remaining = threading.Semaphore(0)

        def write_failed(e: _WriteFailed) -> None:
            with self._write_lock:
                first = not self.report.write_error
                if first:
                    self.report.write_error = str(e)
            if first:
                self.log(f"[synth] stopping: {e}")
            self._stop.set()

        def worker() -> None:
            while True:
                try:
                    persona, state = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self.synthesize(persona, state)
                except _Stop:
                    pass
                except _WriteFailed as e:  # disk full: one line at the end, no thread traceback
                    write_failed(e)
                except APIFatalError as e:
                    self.report.fatal = str(e)
                    self._stop.set()
                    self.log(f"[synth] fatal API error, stopping: {e}")
                except APITransientError as e:
                    try:
                        self._save_state(state)
                    except _WriteFailed as failed:
                        write_failed(failed)
                    self.report.unfinished += 1
                    self.progress.update(unfinished=1, settled=persona.id)
                    self.log(f"[synth] {persona.id}: left in-flight ({e}); rerun to resume it")
                except Exception as e:  # a bug must not cost the other personas their work
                    self.report.fatal = f"{type(e).__name__}: {e}"
                    self._stop.set()
                    self.log(f"[synth] internal error on {persona.id}, stopping: {self.report.fatal}")
                    raise
                finally:
                    remaining.release()

        # Daemon threads: on Ctrl-C the main thread returns at once; saved state covers the
        # requests still in the air.
        threads = [
            threading.Thread(target=worker, daemon=True, name=f"synth-{i}")
            for i in range(max(1, min(cfg.concurrency, len(work))))
        ]
        for t in threads:
            t.start()
        try:
            for _ in range(len(work)):
                while not remaining.acquire(timeout=0.25):
                    self.progress.tick()
                    if self._stop.is_set() and not any(t.is_alive() for t in threads):
                        break
                if self._stop.is_set() and not any(t.is_alive() for t in threads):
                    break
            for t in threads:
                t.join()
        except (KeyboardInterrupt, Terminated) as e:
            self._stop.set()
            self.report.interrupted = True
            self.report.terminated = isinstance(e, Terminated)
            how = "terminated (SIGTERM)" if self.report.terminated else "interrupted"
            self.log(f"[synth] {how}: finished personas are saved, in-flight ones resume on restart")

    def _write_summary(self) -> None:
        r = self.report
        jsonl.write_json_atomic(
            self.out / SUMMARY,
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "personas": r.total,
                "finished_before": r.done_before,
                "resumed": r.resumed,
                "succeeded": r.succeeded,
                "failed": r.failed,
                "unfinished": r.unfinished,
                "fatal": r.fatal,
                "interrupted": r.interrupted,
                "persona_skips": r.persona_skips,
                "usage": r.usage.as_dict(),
                "pid": os.getpid(),
            },
        )


def run_generate(cfg: GenerateConfig, *, progress_stream=None) -> GenerateReport:
    return Generator(cfg, progress_stream=progress_stream).run()
