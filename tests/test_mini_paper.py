"""benchmarks/mini_paper.py end to end on a tiny random ChatML Llama (an HF directory with its own
tokenizer.json and chat template, the shape of SmolLM2-135M-Instruct's): every Table 2 setting trains
a couple of steps, base and tuned models play one BabyAI episode and demo worlds, and the report's
Tables 1 and 2 and the episodes table hold every row with the new columns; a second run resumes
(skips everything), a new --out with the run's record goes on where it stopped, and a foreign --out
is refused."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import transformers
from hf_fixtures import build_model, save_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "mini_paper.py"
DEMO = REPO / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as SmolLM2-135M-Instruct ships it in spirit (written here, not copied).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> pathlib.Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("chatml_llama")
    texts = [
        m["content"] for line in DEMO.read_text().splitlines()[:20] for m in json.loads(line)["messages"]
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), attn_implementation="eager",
    )  # fmt: skip
    save_checkpoint(build_model(config, seed=3), out)
    return out


def _run(base: pathlib.Path, out: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    record = out.parent / "record"  # a durable copy of the run, as a second machine would get it
    cmd = [sys.executable, str(SCRIPT), "--base", str(base), "--out", str(out), "--record", str(record),
           "--tokens", "2048",
           "--batch", "1", "--max-length", "1024", "--tasks", "babyai", "--episodes", "1",
           "--demo-episodes", "2", "--max-steps", "2", "--max-new-tokens", "6", "--onpolicy-episodes", "2",
           "-q", *extra]  # fmt: skip
    # As a user runs it: one CPU device, not the 8 the test session's XLA_FLAGS fake for sharding tests.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out.parent, env=env)


def test_mini_paper_end_to_end_and_resume(base_dir, tmp_path):
    from agentrefine_jax.config import TrainConfig

    out = tmp_path / "mini"
    r = _run(base_dir, out, "--task-batch", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    settings = ["agentrefine", "no_refinement_loss", "erroneous_loss", "no_refinement_data"]
    if "objective" in TrainConfig.__dataclass_fields__:
        settings.append("sft_dpo")
    settings.append("onpolicy")
    demo = json.loads((out / "data" / "train.done.json").read_text())
    assert demo["tokens_without_refinement_data"] >= 1.2 * 2048  # enough that no budget repeats a row
    for s in settings:  # the same token budget: 2048 / (1 x 1024) = 2 steps each, under one epoch
        done = json.loads((out / "runs" / f"{s}.done.json").read_text())
        assert done["steps"] == 2 and 0 < done["epochs"] < 1, done
        assert done["train_files"] == ([demo["file"]] if s != "onpolicy" else done["train_files"])
    # The onpolicy row trains on agentrefine's own rejected turns (a random model makes plenty), refined
    # by the expert, mixed with the head of the demo data.
    mix = json.loads((out / "data" / "onpolicy_mix.done.json").read_text())
    onpolicy_rows = (out / "data" / "onpolicy.jsonl").read_text().splitlines()
    assert mix["onpolicy_rows"] == len(onpolicy_rows) >= 1
    assert json.loads((out / "runs" / "onpolicy.done.json").read_text())["train_files"] == mix["files"]
    first = json.loads(onpolicy_rows[0])
    assert any(m.get("loss") is False for m in first["messages"] if m["role"] == "assistant")
    md = (out / "report" / "report.md").read_text()
    t1 = md.split("## Table 1", 1)[1].split("\n## ", 1)[0]
    t2 = md.split("## Table 2", 1)[1].split("\n## ", 1)[0]
    eps = md.split("## Episodes", 1)[1].split("\n## ", 1)[0]
    for label in ["base", *settings]:
        assert f"| {label} |" in t1 and f"| {label} |" in eps
        row = next(line for line in eps.splitlines() if line.startswith(f"| {label} |"))
        assert row.count("n=1;") == 1 and row.count("n=2;") == 1  # babyai, demo world
        assert "valid " in row and "fmt err " in row and "ends: " in row and "95% CI" in row
    rows2 = ("AgentRefine (agentrefine)", "w/o refinement loss (no_refinement_loss)",
             "w/ erroneous loss (erroneous_loss)", "w/o refinement data (no_refinement_data)")  # fmt: skip
    for name in rows2:
        assert f"| {name} |" in t2
    if "sft_dpo" in settings:  # named by its objective too, not as a second "AgentRefine"
        assert "| AgentRefine + DPO (sft_dpo) |" in t2 and "AgentRefine (sft_dpo)" not in t2
    assert "Demo world" in t1 and "BabyAI" in t1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"]["cpu_count"] >= 1 and summary["steps"] == 2
    row = next(x for x in summary["rows"] if x["model"] == "base" and x["task"] == "demo_world")
    assert row["episodes"] == 2 and len(row["success_ci95"]) == 2 and row["variant"] == "original"
    assert row["format_error_rate"] is not None  # a random model's replies
    for label in ["base", *settings]:  # the same unseen worlds under a reworded action set
        cells = {(x["task"], x["variant"]): x for x in summary["rows"] if x["model"] == label}
        assert cells[("demo_world", "perturbation_1")]["episodes"] == 2, sorted(cells)
        assert set(cells) == {
            ("demo_world", "original"),
            ("demo_world", "perturbation_1"),
            ("babyai", "original"),
        }
        assert summary["eval_episodes_per_hour"][label] > 0
        # Every row computes alike (base is an HF directory, the rest trainer checkpoints).
        for task in ("demo_world", "babyai"):
            result = json.loads((out / "eval" / label / f"{task}.json").read_text())
            assert result["compute_dtype"] == "float32", (label, task, result["model"])
            # --task-batch bounds the built-in tasks' episodes in flight; demo worlds keep --eval-batch.
            assert result["config"]["batch_size"] == (32 if task == "demo_world" else 1), (label, task)
    assert all("recovery_rate" in x and "repeated_error_rate" in x for x in summary["rows"])
    assert any(v.startswith("recovery demo_world/original") for v in summary["verdict"])
    assert "CPUs" in r.stdout and "done in" in r.stdout
    # Resume on a new machine: the record (--record) was kept after every stage; a new --out with it and
    # one evaluation missing goes on from there: agentrefine is trained again for its checkpoint, the
    # same model, so its BabyAI episode is played exactly as before; nothing else runs again.
    record = tmp_path / "record"
    assert sorted(p.name for p in (record / "eval" / "agentrefine").iterdir()) == [
        "babyai.json", "babyai.machine.json", "demo_world.json", "demo_world.machine.json"
    ]  # fmt: skip
    assert (record / "data" / "onpolicy.jsonl").read_bytes() == (out / "data" / "onpolicy.jsonl").read_bytes()
    assert not list(record.glob("runs/*/**")) and not (record / "data" / "train.jsonl").exists()
    before = json.loads((record / "eval" / "agentrefine" / "babyai.json").read_text())
    (record / "eval" / "agentrefine" / "babyai.json").unlink()
    out2 = tmp_path / "mini_elsewhere"
    r5 = _run(base_dir, out2, "--task-batch", "1")
    assert r5.returncode == 0, r5.stdout[-3000:] + r5.stderr[-3000:]
    assert "restored" in r5.stdout and "agentrefine: trained earlier on another machine" in r5.stdout
    assert r5.stdout.count(": training 2 steps") == 1 and r5.stdout.count("evaluating") == 1, r5.stdout
    assert "agentrefine/babyai: evaluating" in r5.stdout and "collecting" not in r5.stdout
    # every other setting's training and every other (model, task) evaluation
    assert r5.stdout.count("skipped") == len(settings) - 1 + 2 * (len(settings) + 1) - 1, r5.stdout
    again = json.loads((record / "eval" / "agentrefine" / "babyai.json").read_text())
    timeless = lambda doc: [{k: v for k, v in e.items() if k != "seconds"} for e in doc["episodes"]]  # noqa: E731
    assert timeless(again) == timeless(before)
    summary2 = json.loads((out2 / "summary.json").read_text())
    assert summary2["rows"] == summary["rows"] and summary2["pending"] == []
    assert summary2["stage_machines"]["eval agentrefine/babyai"].endswith(")")
    # Other settings on the same --out, or a foreign non-empty --out: one line, exit 2.
    r3 = _run(base_dir, out, "--lr", "1e-3")
    assert r3.returncode == 2 and "other settings" in r3.stderr and "Traceback" not in r3.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r4 = _run(base_dir, foreign)
    assert r4.returncode == 2 and "not a mini-paper output" in r4.stderr
    assert (foreign / "notes.txt").read_text() == "mine"


def test_model_settings_give_the_directory_architecture(tmp_path):
    """SmolLM2-135M-Instruct's shape (9 heads over 3 KV heads, from the tiny preset's 4 over 2; a float32
    round-tripped rms_norm_eps; tied; its own special tokens and context), its tokenizer and template:
    all from the directory, as the trainer resolves the recipe's overrides."""
    import dataclasses

    from agentrefine_jax.config import apply_overrides, load_config
    from agentrefine_jax.hf import model_source
    from agentrefine_jax.hf.io import read_hf_config
    from agentrefine_jax.models.config import HF_FIELDS

    sys.path.insert(0, str(REPO / "benchmarks"))
    import mini_paper

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "max_position_embeddings": 8192, "rms_norm_eps": 9.999999747378752e-06,
              "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")  # only its presence is read here
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    sets = mini_paper.model_settings(tmp_path)
    assert not [s for s in sets if s.startswith("model.")]  # nothing about the model but the directory
    cfg = model_source.resolve(apply_overrides(load_config("tiny"), sets))
    want = read_hf_config(tmp_path)
    for f in dataclasses.fields(want):
        if f.name in HF_FIELDS:
            assert getattr(cfg.model, f.name) == getattr(want, f.name), f.name
    assert (cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.bos_token_id) == (9, 3, 1)
    assert cfg.train.init_from_hf == str(tmp_path.resolve())
    assert (cfg.data.tokenizer, cfg.data.template) == (str(tmp_path.resolve()), "hf")
    assert mini_paper.train_steps(200_000, 4, 512) == 98 and mini_paper.train_steps(1, 4, 512) == 1


def test_recipe_remats_new_runs_and_keeps_a_started_runs_policy(tmp_path):
    """New runs train with remat `full` (the CPU memory fix, docs/scale.md); a run directory started
    before under remat `none` resumes under it, since resuming refuses a changed model config."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import mini_paper

    assert mini_paper.remat_policy(tmp_path / "new") == "full"
    (tmp_path / "config.json").write_text(json.dumps({"model": {"remat_policy": "none"}}))
    assert mini_paper.remat_policy(tmp_path) == "none"


def test_sigterm_stops_the_whole_script_with_75(base_dir, tmp_path):
    """SIGTERM while a setting trains: the trainer gets it (saves, exits 75) and no later stage
    starts — the script exits 75 with one line saying how to resume, not on to the next setting."""
    import signal
    import time

    out = tmp_path / "mini"
    cmd = [sys.executable, str(SCRIPT), "--base", str(base_dir), "--out", str(out), "--tokens", "8192",
           "--batch", "1", "--max-length", "512", "--tasks", "babyai", "--episodes", "1", "-q",
           "--only", "agentrefine,no_refinement_loss"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = out / "runs" / "agentrefine.log"
    deadline = time.monotonic() + 600
    while "step 1/" not in (log.read_text() if log.exists() else ""):  # the trainer is stepping
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 75, stdout
    assert stdout.count(": training") == 1 and "evaluating" not in stdout, stdout
    assert (
        stdout.strip()
        .splitlines()[-1]
        .endswith("stopped (SIGTERM) during agentrefine's training; rerun the same command to resume")
    ), stdout
    assert "Traceback" not in stdout
    assert any((out / "runs" / "agentrefine" / "checkpoints").iterdir())  # the trainer saved on SIGTERM
    # The same run with a record's `done` from another machine (what --record restores): the stopped
    # training is not the model; it resumes, and nothing is exported or evaluated before it ends.
    (out / "runs" / "agentrefine.done.json").write_text('{"setting": "agentrefine", "steps": 16}')
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen, first = [], ""  # the first line that says what the script does with the setting
    for line in proc.stdout:
        seen.append(line)
        if ": training" in line or "exporting" in line or "evaluating" in line:
            first = line
            break
    proc.send_signal(signal.SIGTERM)
    seen.append(proc.communicate(timeout=600)[0])
    assert ": training 16 steps" in first, "".join(seen)
    assert not (out / "hf" / "agentrefine").exists(), "".join(seen)


def test_verdict_names_only_rows_whose_interval_lies_above_base():
    """The README's sentence comes from the rows: a tuned row counts only when its Wilson interval's
    lower end is above base's upper end, per task and variant; recovery is given per model."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import mini_paper

    def row(model, task, successes, n, recovered=0, after=0):
        ci = mini_paper.wilson_interval(successes, n)
        rate = recovered / after if after else None
        return {"model": model, "task": task, "variant": "original", "success_ci95": list(ci),
                "after_error_turns": after, "recovery_rate": rate}  # fmt: skip

    rows = [row("base", "demo_world", 0, 64, 5, 50), row("agentrefine", "demo_world", 20, 64, 40, 50),
            row("erroneous_loss", "demo_world", 3, 64, 10, 50), row("base", "babyai", 2, 16),
            row("agentrefine", "babyai", 5, 16)]  # fmt: skip
    says = mini_paper.verdict(rows)
    assert "demo_world/original: above base: agentrefine" in says  # 20/64 [21-43%] vs 0/64 [0-5.7%]
    assert "babyai/original: no tuned row's success interval lies above base's" in says  # 5/16 vs 2/16
    rec = next(s for s in says if s.startswith("recovery demo_world/original"))
    assert "agentrefine 80.0 [" in rec and "base 10.0 [" in rec


def test_a_row_played_by_two_different_models_says_so(tmp_path):
    """A row's merged result names the model that played every task; where its tasks were played by
    different models (trained again on another kind of CPU, not bit-identical) the result keeps each
    task's and the script warns. Real per-task results: the committed record's base row."""
    import argparse

    sys.path.insert(0, str(REPO / "benchmarks"))
    import mini_paper

    kept = REPO / "benchmarks" / "records" / "mini_paper" / "eval" / "base"
    if not (kept / "babyai.json").exists():
        pytest.skip("the record's base results are not in this checkout")
    args = argparse.Namespace(tasks=["babyai"])
    docs = {t: json.loads((kept / f"{t}.json").read_text()) for t in ("demo_world", "babyai")}
    for label, other in (("same", None), ("mixed", "f" * 64)):
        for task, doc in docs.items():
            if other and task == "babyai":
                doc = doc | {"model": doc["model"] | {"fingerprint": other}}
            path = tmp_path / "eval" / label / f"{task}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc))
    lines: list[str] = []
    same = json.loads(mini_paper.merged_result(args, "same", tmp_path, lines.append).read_text())
    assert same["model"] == docs["babyai"]["model"] and "models" not in same and lines == []
    mixed = json.loads(mini_paper.merged_result(args, "mixed", tmp_path, lines.append).read_text())
    fingerprint = docs["demo_world"]["model"]["fingerprint"]
    assert mixed["models"] == {"demo_world": fingerprint, "babyai": "f" * 64} and "model" not in mixed
    assert len(lines) == 1 and lines[0].startswith("warning: mixed's tasks were played by different models")
    assert f"demo_world: {fingerprint[:12]}" in lines[0] and len(mixed["episodes"]) == 128 + 16


def test_record_keeps_a_journal_only_while_its_evaluation_is_unfinished(tmp_path):
    """A record (--record) copies what finished stages made and an unfinished evaluation's journal;
    once the evaluation finishes (eval removes its journal) the record's copy goes too; restoring into
    a new --out copies what it lacks and keeps what it has; a foreign directory is never a record."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import _outdir
    import _record
    import mini_paper

    out, record, again = tmp_path / "out", tmp_path / "record", tmp_path / "again"
    _record.prepare(record, {"tokens": 1}, tool="mini_paper", what="mini-paper")
    journal = out / "eval" / "base" / "demo_world.json.journal.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text('{"journal": 1}\n{"key": "[0]", "record": {}}\n')
    (out / "runs").mkdir()
    (out / "runs" / "agentrefine.done.json").write_text('{"steps": 80}')
    (out / "runs" / "agentrefine").mkdir()
    (out / "runs" / "agentrefine" / "model.bin").write_bytes(b"weights")  # a checkpoint: never recorded
    files, transient = mini_paper.RECORD_FILES, mini_paper.JOURNALS
    assert _record.save(out, record, files, transient=transient) == 2
    assert (record / "eval" / "base" / "demo_world.json.journal.jsonl").read_text() == journal.read_text()
    assert not (record / "runs" / "agentrefine").exists()
    assert _record.save(out, record, files, transient=transient) == 0  # nothing changed, nothing written
    journal.unlink()  # the evaluation finished: its result in place of the journal
    (out / "eval" / "base" / "demo_world.json").write_text('{"episodes": []}')
    assert _record.save(out, record, files, transient=transient) == 1
    assert not (record / "eval" / "base" / "demo_world.json.journal.jsonl").exists()
    again.mkdir()
    (again / "runs").mkdir()
    (again / "runs" / "agentrefine.done.json").write_text("mine")
    lines = []
    assert _record.restore(record, again, mini_paper.RESTORED_FILES, lines.append) == 1
    assert (again / "eval" / "base" / "demo_world.json").read_text() == '{"episodes": []}'
    assert (again / "runs" / "agentrefine.done.json").read_text() == "mine" and "restored 1" in lines[0]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(_outdir.OutDirError, match="--record .*not a mini-paper record"):
        _record.prepare(foreign, {"tokens": 1}, tool="mini_paper", what="mini-paper")
    with pytest.raises(_outdir.OutDirError, match="--record .* other settings"):
        _record.prepare(record, {"tokens": 2}, tool="mini_paper", what="mini-paper")


def test_record_keeps_each_finished_task_when_the_machine_is_lost_mid_model(base_dir, tmp_path):
    """The record is saved after every task's evaluation, not only after a whole model: a machine
    lost (SIGKILL: nothing runs after it) while base plays its second task still has the first
    task's result in the record, and a new --out with that record evaluates only the second."""
    import signal
    import time

    out, record = tmp_path / "mini", tmp_path / "record"
    cmd = [sys.executable, str(SCRIPT), "--base", str(base_dir), "--out", str(out), "--record", str(record),
           "--tasks", "babyai", "--episodes", "1", "--demo-episodes", "2", "--max-steps", "2",
           "--max-new-tokens", "6", "-q", "--only", "base"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:  # until the second task starts
        lines.append(line)
        if "base/babyai: evaluating" in line:
            break
        assert time.monotonic() < deadline, "".join(lines)
    else:
        raise AssertionError("".join(lines))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert "base/demo_world: evaluated in" in "".join(lines)
    kept = json.loads((record / "eval" / "base" / "demo_world.json").read_text())
    assert len(kept["episodes"]) == 4  # 2 worlds x (original, one rewording)
    assert (record / "eval" / "base" / "demo_world.machine.json").exists()
    assert not (record / "eval" / "base" / "babyai.json").exists()
    elsewhere = [*cmd[:5], str(tmp_path / "elsewhere"), *cmd[6:]]
    r = subprocess.run(elsewhere, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "base/demo_world: evaluated earlier, skipped" in r.stdout
    assert r.stdout.count("evaluating") == 1 and "base/babyai: evaluating" in r.stdout, r.stdout


def test_a_tuned_rows_unfinished_evaluation_and_collection_resume_on_another_machine(base_dir, tmp_path):
    """A tuned row is evaluated, and the onpolicy row's data collected, from an HF export of agentrefine's
    final step, so each journal is bound to the parameters' content: stopped after one episode, its machine
    lost (--out gone, the record kept), the same command trains the row again and the journal resumes.
    Played from the checkpoint itself, a journal was bound to Orbax's files, whose names differ between two
    saves of the same parameters, and the next machine's evaluation was refused; the collection's journal
    was not in the record at all."""
    import shutil

    record, out = tmp_path / "record", tmp_path / "mini"
    cmd = [sys.executable, str(SCRIPT), "--base", str(base_dir), "--out", str(out), "--record", str(record),
           "--tokens", "2048", "--batch", "1", "--max-length", "1024", "--tasks", "babyai", "--episodes", "1",
           "--demo-episodes", "2", "--max-steps", "2", "--max-new-tokens", "6", "--settings",
           "agentrefine,onpolicy", "--onpolicy-episodes", "2", "--eval-batch", "1", "-q"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "AGENTREFINE_FAULT")}

    def run(only: str, stop_after_one: bool) -> subprocess.CompletedProcess:
        # SIGTERM after the first episode this process journals
        fault = {"AGENTREFINE_FAULT": "after_episode@1:TERM"} if stop_after_one else {}
        r = subprocess.run(
            [*cmd, "--only", only], capture_output=True, text=True, timeout=900, env=env | fault
        )
        assert r.returncode == (75 if stop_after_one else 0), r.stdout[-3000:] + r.stderr[-3000:]
        assert "holds episodes of" not in r.stdout + r.stderr, r.stderr[-3000:]
        return r

    stopped = run("agentrefine", stop_after_one=True)
    journal = record / "eval" / "agentrefine" / "demo_world.json.journal.jsonl"
    header, *episodes = journal.read_text().splitlines()
    assert len(episodes) == 1
    shutil.rmtree(out)  # the machine is lost: checkpoint, export and all; the record survives
    again = run("agentrefine", stop_after_one=False)
    assert "agentrefine: trained earlier on another machine" in again.stdout
    assert "error:" not in again.stdout, again.stdout[-4000:]
    # the lost machine's training stays on record beside the one that made the checkpoint now
    trained = json.loads((record / "runs" / "agentrefine.done.json").read_text())
    assert [t["steps"] for t in trained["earlier"]] == [trained["steps"]]
    doc = json.loads((record / "eval" / "agentrefine" / "demo_world.json").read_text())
    # 2 worlds x 2 wordings, the first from the lost machine's sitting: the journal was resumed
    assert len(doc["episodes"]) == 4 and doc["sittings"] == 2 and doc["compute_dtype"] == "float32"
    hf = out / "hf" / "agentrefine"  # what was played, both times: the export
    assert json.loads(header)["model"]["checkpoint"] == doc["model"]["checkpoint"] == str(hf)
    assert "agentrefine: exporting" in stopped.stdout and "agentrefine: exporting" in again.stdout
    assert not journal.exists()  # finished: the record keeps the result, not the journal

    # The collection plays the same export; stopped after its first episode, then the machine is lost.
    run("onpolicy", stop_after_one=True)
    collected = record / "data" / "onpolicy.jsonl.journal.jsonl"
    header, *episodes = collected.read_text().splitlines()
    assert len(episodes) == 1 and json.loads(header)["model"]["checkpoint"] == str(hf)
    shutil.rmtree(out)
    resumed = run("onpolicy", stop_after_one=True)  # trained again, exported, resumed: stops after the 2nd
    assert "agentrefine: trained earlier on another machine" in resumed.stdout
    # one episode restored + the one this sitting played (started afresh, it would hold one)
    assert "2 finished episodes kept" in resumed.stderr, resumed.stderr[-3000:]
    trained = json.loads((record / "runs" / "agentrefine.done.json").read_text())
    assert len(trained["earlier"]) == 2 and "earlier" not in trained["earlier"][1]
    header2, *episodes = collected.read_text().splitlines()
    assert len(episodes) == 2 and json.loads(header2)["model"] == json.loads(header)["model"]


def test_record_is_refreshed_while_a_long_evaluation_runs(tmp_path):
    """Between stages the record is refreshed every --record-every seconds: an evaluation's growing
    journal reaches it while the evaluation still runs (a session ending without SIGTERM loses at
    most that interval of episodes), and saves by the script itself never overlap a refresh."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import time

    import _record
    import mini_paper

    out, record = tmp_path / "out", tmp_path / "record"
    _record.prepare(record, {"tokens": 1}, tool="mini_paper", what="mini-paper")
    journal = out / "eval" / "base" / "demo_world.json.journal.jsonl"
    journal.parent.mkdir(parents=True)
    copy = record / journal.relative_to(out)
    calls = []

    def save() -> None:
        calls.append(time.monotonic())
        _record.save(out, record, mini_paper.RECORD_FILES, transient=mini_paper.JOURNALS)

    def reaches_record(text: str) -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if copy.exists() and copy.read_text() == text:
                return True
            time.sleep(0.05)
        return False

    with _record.Refresher(save, every_s=0.2) as keep:
        journal.write_text('{"journal": 1}\n{"key": "[0]", "record": {}}\n')
        assert reaches_record(journal.read_text())  # no stage has ended: the refresh copied it
        with journal.open("a") as f:
            f.write('{"key": "[1]", "record": {}}\n')
        assert reaches_record(journal.read_text())
        keep()  # the script's own save, serialised with the thread's
    n = len(calls)
    time.sleep(0.6)
    assert len(calls) == n  # no refresh after the block
    args = mini_paper.build_parser().parse_args(["--base", "b", "--out", "o"])
    assert args.record_every == 600
