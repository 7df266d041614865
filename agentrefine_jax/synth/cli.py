"""`python -m agentrefine_jax.synth {generate,verify,convert}` (see docs/synth.md)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys

from agentrefine_jax import logs, outputs
from agentrefine_jax.cli_errors import OneLineParser, fail, float_in, write_failed
from agentrefine_jax.synth import jsonl, out_dir
from agentrefine_jax.synth.convert import convert_file
from agentrefine_jax.synth.generate import OWN, GenerateConfig, run_generate
from agentrefine_jax.synth.llm import LLMSettings
from agentrefine_jax.synth.personas import PACKAGED
from agentrefine_jax.synth.verify import INVALID_UNICODE, UNPARSED, turn_verdicts, verify_trajectory


def _err(msg: str) -> None:
    fail("synth", msg)


def cmd_generate(a: argparse.Namespace) -> int:
    common = dict(
        temperature=a.temperature,
        max_tokens=a.max_tokens,
        timeout=a.timeout,
        max_api_retries=a.max_api_retries,
        backoff_base=a.backoff_base,
        backoff_max=a.backoff_max,
    )
    traj = LLMSettings(base_url=a.base_url, model=a.model, api_key_env=a.api_key_env, **common)
    script = LLMSettings(
        base_url=a.script_base_url or a.base_url,
        model=a.script_model or a.model,
        api_key_env=a.script_api_key_env or a.api_key_env,
        **common,
    )
    cfg = GenerateConfig(
        personas=pathlib.Path(a.personas),
        out_dir=pathlib.Path(a.out),
        script_llm=script,
        trajectory_llm=traj,
        concurrency=a.concurrency,
        max_retries=a.max_retries,
        limit=a.limit,
        progress_interval=a.progress_interval,
    )
    if a.concurrency < 1 or a.max_retries < 0:
        _err("--concurrency must be >= 1 and --max-retries >= 0")
        return 2
    try:
        # -q: no progress line or per-persona messages (errors still reach stderr as one line)
        report = run_generate(cfg, progress_stream=open(os.devnull, "w") if a.quiet else None)
    except (FileNotFoundError, out_dir.OutDirError, out_dir.OutDirInUse) as e:
        _err(str(e))
        return 2
    u = report.usage
    print(
        f"[synth] generate: {report.succeeded} verified, {report.failed} failed, "
        f"{report.unfinished} unfinished this run ({report.done_before} finished earlier); "
        f"tokens: {u.prompt_tokens:,} prompt + {u.completion_tokens:,} completion in {u.calls} calls",
        file=sys.stderr,
        flush=True,
    )
    if report.terminated:
        print(
            "[synth] terminated (SIGTERM); run the same command again to resume", file=sys.stderr, flush=True
        )
    elif report.fatal:
        _err(report.fatal)
    elif report.write_error:
        write_failed("synth", report.write_error)
    elif report.unfinished and not report.interrupted:
        _err(f"{report.unfinished} persona(s) unfinished (API errors); rerun the same command to resume")
    return report.exit_code


def cmd_verify(a: argparse.Namespace) -> int:
    reasons: collections.Counter[str] = collections.Counter()
    rows = []
    try:
        lines = list(jsonl.iter_lines(a.input))
    except (FileNotFoundError, UnicodeDecodeError) as e:
        _err(f"cannot read {a.input}: {e}")
        return 2
    for n, line in enumerate(lines, start=1):
        result = verify_trajectory(line)
        rid, verdicts = None, []
        if result.reason not in (*UNPARSED, INVALID_UNICODE):  # else the id may not parse or encode
            obj = json.loads(line)
            rid = obj.get("id") if isinstance(obj, dict) else None
            verdicts = turn_verdicts(obj)
        rows.append(
            {
                "id": rid,
                "ok": result.ok,
                "verified_turns": result.verified_turns,
                "reason": result.reason,
                "detail": result.detail,
                "line": n,
                # the judge's per-turn verdicts (analyze judge-agreement compares them with a human's)
                "turns": verdicts,
            }
        )
        reasons[result.reason] += 1
    jsonl.write_atomic(a.out, rows)
    passed = reasons.pop("ok", 0)
    print(
        f"[synth] verify: {len(rows)} line(s), {passed} pass, {len(rows) - passed} fail"
        + (f" {dict(sorted(reasons.items()))}" if reasons else "")
        + f" -> {a.out}",
        file=sys.stderr,
    )
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    try:
        summary = convert_file(a.input, a.out, style=a.prompt_style)
    except (FileNotFoundError, UnicodeDecodeError) as e:
        _err(f"cannot read {a.input}: {e}")
        return 2
    d = summary.as_dict()
    print(
        f"[synth] convert: read {d['read']}, wrote {d['written']} -> {a.out}; "
        f"dropped {sum(d['dropped'].values())}: {d['dropped']}; "
        f"{d['error_turns']}/{d['assistant_turns']} assistant turns are erroneous (loss false)",
        file=sys.stderr,
    )
    if a.summary:
        jsonl.write_json_atomic(a.summary, d)
    return 0


def cmd_replay_server(a: argparse.Namespace) -> int:
    """Serve scripted chat-completion replies (tests, demos) until Ctrl-C."""
    import json
    import time

    from agentrefine_jax.synth.replay_server import ReplayServer

    with open(a.replies, encoding="utf-8") as f:
        rules = json.load(f)["rules"]
    server = ReplayServer(rules, a.host, a.port).start()
    print(f"[replay] serving {len(rules)} rule(s) at {server.url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m agentrefine_jax.synth", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="persona -> script -> trajectory -> Algorithm 1, resumable")
    g.add_argument(
        "--personas",
        default=str(PACKAGED),
        help="text (one persona a line) or JSONL (Persona Hub layout); default: the packaged list",
    )
    g.add_argument("--out", required=True, help="output directory (resumes if it already has results)")
    g.add_argument(
        "--base-url", required=True, help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1"
    )
    g.add_argument("--model", required=True, help="model for trajectory generation")
    g.add_argument("--script-model", help="model for script generation (default: --model)")
    g.add_argument("--script-base-url", help="endpoint for script generation (default: --base-url)")
    g.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key")
    g.add_argument("--script-api-key-env", help="key variable for --script-base-url (default: --api-key-env)")
    g.add_argument("--concurrency", type=int, default=4, help="personas processed at once")
    g.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="regenerations per persona after a failed verification / unusable script",
    )
    g.add_argument("--max-api-retries", type=int, default=6, help="retries of one request on 429/5xx/timeout")
    g.add_argument("--backoff-base", type=float, default=1.0, help="first backoff delay in seconds (doubles)")
    g.add_argument("--backoff-max", type=float, default=60.0, help="longest backoff delay in seconds")
    g.add_argument(
        "--timeout",
        type=float_in(0, 86400, lo_open=True),
        default=300.0,
        help="deadline in seconds for each whole request (connect + complete reply, not per read)",
    )
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--max-tokens", type=int, default=None, help="completion token cap per request")
    g.add_argument("--limit", type=int, default=None, help="only the first N personas")
    g.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        help="seconds between status lines when stderr is not a terminal",
    )
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("verify", help="Algorithm 1 verdict for every line of a raw JSONL file")
    v.add_argument("--input", required=True)
    v.add_argument(
        "--out", required=True, help='report JSONL: {"id","ok","verified_turns","reason",...,"turns"}'
    )
    v.set_defaults(func=cmd_verify)

    c = sub.add_parser("convert", help="verified raw trajectories -> canonical chat training JSONL")
    c.add_argument("--input", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--summary", help="also write the drop summary as JSON here")
    c.add_argument(
        "--prompt-style",
        choices=("chat", "agentboard"),
        default="chat",
        help="agentrefine_jax.layout style: chat = one multi-turn conversation per trajectory "
        "(what `eval --prompt-style chat` sends); agentboard = one row per trained turn, its "
        "history in AgentBoard's single user message",
    )
    c.set_defaults(func=cmd_convert)

    r = sub.add_parser("replay-server", help="serve scripted OpenAI-compatible replies on 127.0.0.1")
    r.add_argument("--replies", required=True, help='JSON file {"rules": [...]}')
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8765)
    r.set_defaults(func=cmd_replay_server)
    for command in sub.choices.values():
        logs.add_flags(command)
    return p


def check_outputs(a: argparse.Namespace) -> None:
    """Every output path, before any work: the right kind, writable, never one of the inputs."""
    if a.command == "generate":
        out_dir.check(pathlib.Path(a.out), OWN)  # resumable: only a directory generate made
        return
    if a.command == "replay-server":
        return  # writes nothing
    if not os.path.isfile(a.input):
        return  # the command reports an input it cannot read, before any output matters
    outputs.check_file(a.out, inputs=[a.input])
    if getattr(a, "summary", None):
        outputs.check_file(a.summary, inputs=[a.input], flag="--summary")
        if os.path.realpath(a.summary) == os.path.realpath(a.out):
            raise outputs.OutputError(f"--summary {a.summary} is also --out; name two files")


def special_input(a: argparse.Namespace) -> str | None:
    """An input that exists but is no regular file (a FIFO would block the read forever)."""
    for flag in ("input", "personas", "replies"):
        path = getattr(a, flag, None)
        if path and os.path.exists(path) and not os.path.isfile(path):
            return f"--{flag} {path} is not a regular file (a directory, FIFO, device or socket)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup("synth", args)
    if why := special_input(args):
        return fail("synth", why)
    try:
        check_outputs(args)
    except outputs.OutputError as e:
        return fail("synth", e)
    return args.func(args)
