"""HotpotQA (Figure 8): data, sampling, both search backends, EM/F1 and whole episodes.

The fixture (tests/data/hotpotqa_fixture.json) is hand-written in the official layout: 22 questions,
bridge and comparison types, six yes/no answers. The `wikipedia` backend runs against a loopback
MediaWiki server answering in the action API's JSON shapes (formatversion=2).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai_fixture import chat_completion, send_json

from agentrefine_jax.eval.hotpotqa import (
    DataError,
    HotpotQATask,
    NotFound,
    Page,
    Question,
    SearchError,
    WikipediaBackend,
    exact_match,
    f1_score,
    load_questions,
    normalize_answer,
)

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).parent / "data" / "hotpotqa_fixture.json"
RECORDS = json.loads(FIXTURE.read_text(encoding="utf-8"))


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    """A loopback HTTP server for `handler` while the block runs; yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# ------------------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize(
    ("prediction", "gold", "em", "f1"),
    [
        ("The Eiffel Tower", "eiffel tower", True, 1.0),  # article and case
        ("  Eiffel   Tower! ", "the eiffel tower.", True, 1.0),  # punctuation and spaces
        ("an apple", "Apple", True, 1.0),
        ("1,902", "1902", True, 1.0),  # the comma is punctuation
        ("No.", "no", True, 1.0),
        ("River Tane in Elsford", "the River Tane", False, 2 * 0.5 * 1.0 / 1.5),  # P 2/4, R 2/2
        ("Hugh", "Hugh Castellane", False, 2 * 1.0 * 0.5 / 1.5),  # P 1/1, R 1/2
        ("about 140 000", "about 140,000", False, 2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2)),  # P 1/3, R 1/2
        ("Moira Fenwick Fenwick", "Moira Fenwick", False, 2 * (2 / 3) * 1.0 / (2 / 3 + 1)),  # clipped counts
        ("yes", "no", False, 0.0),
        ("yes it is", "yes", False, 0.0),  # no partial credit on a yes/no gold answer
        ("no", "no way out", False, 0.0),  # nor for a yes/no prediction
        ("unknown", "Marrowby", False, 0.0),
        ("", "Marrowby", False, 0.0),
    ],
)
def test_em_f1_hand_computed(prediction: str, gold: str, em: bool, f1: float):
    assert exact_match(prediction, gold) is em
    assert f1_score(prediction, gold) == pytest.approx(f1, abs=1e-12)


def test_normalisation_steps():
    assert normalize_answer('The  Band\'s "Quiet"  Engines, an Album!') == "bands quiet engines album"
    # Articles are whole words only; punctuation goes before the article rule (as the official script).
    assert normalize_answer("Theatre of the Anarchy") == "theatre of anarchy"
    assert normalize_answer("a-ha") == "aha"


# ------------------------------------------------------------------------------------------ data


def test_load_official_layout():
    questions = load_questions(str(FIXTURE))
    assert len(questions) == 22
    assert {q.type for q in questions} == {"bridge", "comparison"}
    assert sum(q.answer in ("yes", "no") for q in questions) == 6
    q = questions[0]
    assert (q.id, q.answer, q.supporting_titles) == (
        "hq-fixture-01",
        "Marrowby",
        ("The Salt Road", "Edith Varley"),
    )
    # The official files keep a leading space on later sentences; it is stripped.
    assert dict(q.context)["Edith Varley"][1] == "She was born in Marrowby and educated at Girton College."
    assert questions[11].supporting_titles == ("Fenwick Records", "Moira Fenwick", "Dunmarch")


def _hf_rows() -> list[dict]:
    """The fixture in the Hugging Face `hotpot_qa` layout (what its parquet files hold)."""
    return [
        {
            "id": r["_id"],
            "question": r["question"],
            "answer": r["answer"],
            "type": r["type"],
            "level": r["level"],
            "supporting_facts": {
                "title": [t for t, _ in r["supporting_facts"]],
                "sent_id": [i for _, i in r["supporting_facts"]],
            },
            "context": {"title": [t for t, _ in r["context"]], "sentences": [s for _, s in r["context"]]},
        }
        for r in RECORDS
    ]


def test_jsonl_parquet_and_datasets_sources_agree(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    reference = load_questions(str(FIXTURE))
    jsonl = tmp_path / "dev.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    assert load_questions(str(jsonl)) == reference

    parquet = tmp_path / "dev.parquet"
    pq.write_table(pa.Table.from_pylist(_hf_rows()), parquet)
    assert load_questions(str(parquet)) == reference

    # A local dataset folder through `datasets` (offline): hf:NAME::SPLIT.
    folder = tmp_path / "hotpot"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(_hf_rows()), folder / "validation.parquet")
    assert load_questions(f"hf:{folder}::validation") == reference


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"data": []}', "expected a JSON list"),
        ("[]", "no questions"),
        (
            '[{"_id": "x", "question": "q?", "context": [["A", ["a."]]], "supporting_facts": [["A", 0]]}]',
            "'answer'",
        ),
        ('[{"question": "q?", "answer": "a"}]', "missing '_id'"),
        (
            '[{"_id": "x", "question": "q?", "answer": "a", "context": [["A", ["a."]]], '
            '"supporting_facts": [["B", 0]]}]',
            "supporting fact titles ['B'] are not in its context",
        ),
        (
            '[{"_id": "x", "question": "q?", "answer": "a", "context": [["A", "a."]], '
            '"supporting_facts": [["A", 0]]}]',
            "is not [title, [sentences]]",
        ),
    ],
)
def test_bad_data_is_one_clear_error(tmp_path: Path, content: str, message: str):
    bad = tmp_path / "bad.json"
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(message)):
        load_questions(str(bad))


def test_missing_file_and_duplicates(tmp_path: Path):
    with pytest.raises(DataError, match="no such HotpotQA file"):
        load_questions(str(tmp_path / "absent.json"))
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps(RECORDS[:2] + RECORDS[:1]), encoding="utf-8")
    with pytest.raises(DataError, match="duplicate question id 'hq-fixture-01'"):
        load_questions(str(dup))


def test_seeded_sampling_is_reproducible(tmp_path: Path):
    task = HotpotQATask(str(tmp_path), data=str(FIXTURE))
    ids = [s["id"] for s in task.episode_specs(22, seed=3)]
    assert ids == [s["id"] for s in HotpotQATask(str(tmp_path), data=str(FIXTURE)).episode_specs(22, seed=3)]
    assert sorted(ids) == sorted(r["_id"] for r in RECORDS)  # a permutation: every question once
    assert [s["id"] for s in task.episode_specs(5, seed=3)] == ids[:5]  # a smaller draw is a prefix
    assert [s["id"] for s in task.episode_specs(22, seed=4)] != ids
    with pytest.raises(DataError, match="asked for 23 questions but the data has only 22"):
        task.episode_specs(23, seed=3)


def test_bad_task_options(tmp_path: Path):
    with pytest.raises(ValueError, match="needs its questions"):
        HotpotQATask(str(tmp_path))
    with pytest.raises(ValueError, match="unknown HotpotQA search backend 'bing'"):
        HotpotQATask(str(tmp_path), data=str(FIXTURE), backend="bing")
    with pytest.raises(ValueError, match=r"unknown hotpotqa option\(s\) \['pages'\]"):
        HotpotQATask(str(tmp_path), data=str(FIXTURE), pages="3")
    with pytest.raises(ValueError, match="bad Wikipedia API URL"):
        HotpotQATask(str(tmp_path), data=str(FIXTURE), backend="wikipedia", wikipedia_url="ftp://x")


# ------------------------------------------------------------------------------------------ environment


def _env(task: HotpotQATask, qid: str):
    spec = next(s for s in task.episode_specs(len(task.questions), 0) if s["id"] == qid)
    env = task.make_env(spec, 0)
    env.reset()
    return env


def test_context_backend_react_semantics(tmp_path: Path):
    env = _env(HotpotQATask(str(tmp_path), data=str(FIXTURE)), "hq-fixture-01")
    assert env.goal == "answer this question: In which town was the author of The Salt Road born?"
    r = env.step("search[Edith Varley]")
    assert r.observation == (
        "Edith Varley (1874 – 1951) was an English novelist. She was born in Marrowby and educated at "
        "Girton College. Her best known novel is The Salt Road (1909)."
    )
    assert (r.valid, r.executed, r.done, r.progress) == (True, True, False, 0.0)
    assert env.step("lookup[born]").observation == (
        "(Result 1 / 1) She was born in Marrowby and educated at Girton College."
    )
    assert env.step("lookup[born]").observation == "No more results."
    # A new keyword starts over; matching is case-insensitive and by substring ("novelist").
    assert (
        env.step("lookup[NOVEL]").observation
        == "(Result 1 / 2) Edith Varley (1874 – 1951) was an English novelist."
    )
    assert (
        env.step("lookup[NOVEL]").observation
        == "(Result 2 / 2) Her best known novel is The Salt Road (1909)."
    )
    # Not in this question's context: the paragraphs sharing words with the entity, title words first.
    assert env.step("search[Hugh Castellane]").observation == (
        "Could not find Hugh Castellane. Similar: ['The Salt Road', 'Kestrel (film)']."
    )
    assert (
        env.step("search[Aldous]").observation
        == "Could not find Aldous. Similar: ['Port Aldous', 'The Salt Road']."
    )
    assert env.step("search[Zzyzx]").observation == "Could not find Zzyzx. Similar: []."
    # The only "Kestrel (...)" paragraph answers a search for Kestrel; titles match up to case and "_".
    assert env.step("search[Kestrel]").observation.startswith("Kestrel is a 1956 British drama film")
    assert env.step("Search[port_aldous]").observation.startswith("Port Aldous is a port city in Elsford")
    # A new page resets lookup.
    assert (
        env.step("lookup[population]").observation == "(Result 1 / 1) It has a population of about 140,000."
    )
    for bad in ("search[]", "jump[Marrowby]", "search Marrowby"):
        r = env.step(bad)
        assert (r.valid, r.executed, r.done) == (False, False, False), bad
        assert r.observation.startswith("Invalid action:"), r.observation
    r = env.step("finish[the  Marrowby.]")
    assert (r.done, r.success, r.progress) == (True, True, 1.0)
    assert r.observation == "Episode finished, reward = 1"


def test_valid_actions_come_from_the_question_not_the_context(tmp_path: Path):
    task = HotpotQATask(str(tmp_path), data=str(FIXTURE))
    env = _env(task, "hq-fixture-03")  # Were The Lanterns and Glass Harbour formed in the same city?
    names = ["The Lanterns", "Glass Harbour"]
    answers = [f"finish[{n}]" for n in names] + ["finish[yes]", "finish[no]"]
    assert env.valid_actions() == [f"search[{n}]" for n in names] + answers
    # The listing never names a paragraph the question does not (the gold page is "The Lanterns (band)").
    listing = env.step("check valid actions")
    assert (listing.valid, listing.executed) == (True, False)
    assert "(band)" not in listing.observation and "Quiet Engines" not in listing.observation
    env.step("search[Glass Harbour]")  # with a page open, lookups too
    assert env.valid_actions() == [f"search[{n}]" for n in names] + [f"lookup[{n}]" for n in names] + answers
    assert _env(task, "hq-fixture-20").valid_actions()[0] == "search[The Lanterns]"  # possessive dropped


def test_long_page_shows_five_sentences_and_lookup_reaches_the_rest(tmp_path: Path):
    sentences = tuple(f"Sentence {i} about Alder." for i in range(1, 8))
    q = Question("long", "Q?", "Alder", "bridge", "easy", ("Alder",), (("Alder", sentences),))
    task = HotpotQATask(str(tmp_path), questions=[q])
    env = task.make_env(task.episode_specs(1, 0)[0], 0)
    env.reset()
    assert env.step("search[Alder]").observation == " ".join(sentences[:5])
    for i in range(1, 8):
        assert env.step("lookup[about]").observation == f"(Result {i} / 7) Sentence {i} about Alder."
    r = env.step("finish[an alder tree]")  # tokens {alder, tree} vs {alder}: P 1/2, R 1
    assert (r.success, r.progress) == (False, pytest.approx(2 / 3))


def test_partial_answer_scores_f1_as_progress(tmp_path: Path):
    env = _env(HotpotQATask(str(tmp_path), data=str(FIXTURE)), "hq-fixture-09")  # gold "about 140,000"
    r = env.step("finish[140,000 people]")
    assert (r.done, r.success) == (True, False)
    assert r.progress == pytest.approx(f1_score("140,000 people", "about 140,000")) == pytest.approx(0.5)


# ------------------------------------------------------------------------------- episodes (the CLI)


def _cli(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    return subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", "--tasks", "hotpotqa", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _results(args: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "results.json"
    proc = _cli(
        ["-q", "--task-option", f"hotpotqa.data={FIXTURE}", "--episodes", "22", "--out", str(out), *args],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    # The table labels the HotpotQA column with its metrics: EM as success, F1 as progress.
    head, sub = proc.stdout.splitlines()[1:3]
    assert head.split()[0] == "HotpotQA" and sub.split()[:3] == ["EM", "/", "F1"], proc.stdout
    return json.loads(out.read_text(encoding="utf-8"))


def test_cli_oracle_scores_em_f1_100(tmp_path: Path):
    doc = _results(["--policy", "oracle"], tmp_path)
    metrics = doc["variants"]["original"]["tasks"]["hotpotqa"]
    assert (metrics["success_rate"], metrics["progress_rate"], metrics["episodes"]) == (1.0, 1.0, 22)
    questions = {q.id: q for q in load_questions(str(FIXTURE))}
    for episode in doc["episodes"]:
        # Each supporting title searched (two, or three for a three-hop question), then the gold answer.
        q = questions[episode["spec"]["id"]]
        assert [t["action"] for t in episode["trace"]] == [
            *(f"search[{t}]" for t in q.supporting_titles),
            f"finish[{q.answer}]",
        ]
        assert episode["termination"] == "success"


def test_cli_best_of_n_takes_each_questions_best_em_and_f1(tmp_path: Path):
    doc = _results(
        ["--policy", "random", "--best-of", "4", "--temperature", "1.0", "--max-steps", "3"], tmp_path
    )
    metrics = doc["variants"]["original"]["tasks"]["hotpotqa"]
    assert (metrics["episodes"], metrics["samples"]) == (22, 88)
    best: dict[int, tuple[float, float]] = {}
    for e in doc["episodes"]:
        em, f1 = best.get(e["episode"], (0.0, 0.0))
        best[e["episode"]] = (max(em, float(e["success"])), max(f1, e["progress"]))
    assert metrics["success_rate"] == pytest.approx(sum(em for em, _ in best.values()) / 22)
    assert metrics["progress_rate"] == pytest.approx(sum(f1 for _, f1 in best.values()) / 22)
    assert metrics["success_rate"] >= metrics["first_sample_success_rate"]
    assert len({tuple(t["action"] for t in e["trace"]) for e in doc["episodes"]}) > 22  # samples differ


class AnswerUnknown(BaseHTTPRequestHandler):
    """An OpenAI-compatible model that always gives up: `finish[unknown]`."""

    prompts: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).prompts.append(body["messages"][-1]["content"])
        reply = chat_completion(body["model"], "Thought: I do not know.\nAction: finish[unknown]")
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_cli_model_answering_unknown_scores_0(tmp_path: Path):
    AnswerUnknown.prompts = []
    with _serving(AnswerUnknown) as port:
        doc = _results(["--base-url", f"http://127.0.0.1:{port}/v1", "--model", "unknown"], tmp_path)
    metrics = doc["variants"]["original"]["tasks"]["hotpotqa"]
    assert (metrics["success_rate"], metrics["progress_rate"], metrics["episodes"]) == (0.0, 0.0, 22)
    assert {(e["steps"], e["termination"]) for e in doc["episodes"]} == {(1, "env_done")}
    # The model saw the instruction, the worked examples and its question.
    assert len(AnswerUnknown.prompts) == 22
    assert all("search[ENTITY]" in p and "(END OF EXAMPLES)" in p for p in AnswerUnknown.prompts)
    assert {
        p.split("Your goal: answer this question: ")[1].split("\n")[0] for p in AnswerUnknown.prompts
    } == {r["question"] for r in RECORDS}


def test_cli_bad_data_is_one_line_exit_2(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"_id": "x", "question": "q?"}]', encoding="utf-8")
    for option, message in (
        (f"hotpotqa.data={bad}", f"[eval] error: {bad}: question 0 (x): missing or non-text 'answer'"),
        (f"hotpotqa.data={tmp_path / 'absent.json'}", "[eval] error: no such HotpotQA file"),
        ("hotpotqa.backend=bing", "[eval] error: unknown HotpotQA search backend 'bing'"),
    ):
        proc = _cli(
            ["--policy", "oracle", "--task-option", f"hotpotqa.data={FIXTURE}", "--task-option", option],
            tmp_path,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message), proc.stderr
        assert proc.stdout == ""
    proc = _cli(["--policy", "oracle"], tmp_path)  # no data at all
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "[eval] error: HotpotQA needs its questions: --task-option hotpotqa.data=FILE"
    )


# ------------------------------------------------------------------------------------------ wikipedia


def _wiki_pages() -> dict[str, str]:
    """Title -> plain-text extract: each fixture paragraph, a section heading and list debris."""
    pages: dict[str, str] = {}
    for r in RECORDS:
        for title, sentences in r["context"]:
            intro = " ".join(s.strip() for s in sentences)
            pages[title] = (
                f"{intro}\n\n\n== Further reading ==\nIndex\nIn {title}, history is recorded locally.\n"
            )
    pages["Kestrel"] = (
        "Kestrel may refer to:\n\nKestrel (bird), a small falcon\nKestrel (film), a 1956 British film"
    )
    pages["Kestrel (bird)"] = "The kestrel is a small bird of prey. It hovers over open country."
    return pages


class FakeMediaWiki(BaseHTTPRequestHandler):
    """MediaWiki's action API (api.php?action=query&format=json&formatversion=2), on loopback."""

    pages: dict[str, str] = _wiki_pages()
    redirects = {"H. Castellane": "Hugh Castellane"}
    disambiguation = {"Kestrel"}
    log: list[dict[str, str]] = []
    # Answers with HTTP 503 while > 0 (a transient failure the client retries).
    fail_next = 0

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, doc: object) -> None:
        send_json(self, status, doc, content_type="application/json; charset=utf-8")

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/w/api.php":
            self._send(404, {"error": "not found"})
            return
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        type(self).log.append(q)
        if type(self).fail_next > 0:
            type(self).fail_next -= 1
            self._send(503, {"error": "busy"})
            return
        if (q.get("action"), q.get("format"), q.get("formatversion")) != ("query", "json", "2"):
            self._send(200, {"error": {"code": "badvalue", "info": "unsupported request"}})
            return
        if "titles" in q:
            self._send(200, {"batchcomplete": True, "query": self._titles(q)})
        elif q.get("list") == "search":
            self._send(200, {"batchcomplete": True, "query": self._search(q)})
        else:
            self._send(200, {"error": {"code": "noquery", "info": "nothing asked"}})

    def _titles(self, q: dict[str, str]) -> dict[str, object]:
        raw = q["titles"]
        title = raw.replace("_", " ").strip()
        title = title[:1].upper() + title[1:]  # MediaWiki capitalises the first letter only
        out: dict[str, object] = {}
        if title != raw:
            out["normalized"] = [{"fromencoded": False, "from": raw, "to": title}]
        if q.get("redirects") and title in self.redirects:
            out["redirects"] = [{"from": title, "to": self.redirects[title]}]
            title = self.redirects[title]
        if title not in self.pages:
            out["pages"] = [{"ns": 0, "title": title, "missing": True}]
            return out
        page: dict[str, object] = {"pageid": 1000 + sorted(self.pages).index(title), "ns": 0, "title": title}
        if "extracts" in q.get("prop", "").split("|"):
            page["extract"] = self.pages[title]
        if title in self.disambiguation and "disambiguation" in q.get("ppprop", ""):
            page["pageprops"] = {"disambiguation": ""}
        out["pages"] = [page]
        return out

    def _search(self, q: dict[str, str]) -> dict[str, object]:
        words = set(q["srsearch"].lower().split())
        scored = []
        for title, text in self.pages.items():
            score = 2 * len(words & set(title.lower().split())) + len(words & set(text.lower().split()))
            if score:
                scored.append((-score, title))
        limit = int(q.get("srlimit", 10))
        hits = [
            {
                "ns": 0,
                "title": title,
                "pageid": 1000 + sorted(self.pages).index(title),
                "size": len(self.pages[title]),
                "wordcount": len(self.pages[title].split()),
                "snippet": f'<span class="searchmatch">{title}</span>',
                "timestamp": "2024-05-01T12:00:00Z",
            }
            for _, title in sorted(scored)[:limit]
        ]
        return {"searchinfo": {"totalhits": len(scored)}, "search": hits}


@pytest.fixture
def wiki() -> Iterator[str]:
    FakeMediaWiki.log = []
    FakeMediaWiki.fail_next = 0
    with _serving(FakeMediaWiki) as port:
        yield f"http://127.0.0.1:{port}/w/api.php"


def test_wikipedia_backend_against_mediawiki_shapes(wiki: str):
    backend = WikipediaBackend(wiki, timeout=5.0, retries=0)
    page = backend.search("Edith Varley")
    assert isinstance(page, Page) and page.title == "Edith Varley"
    # Headings and the two-word list line are dropped; the later section's sentence stays for lookup.
    assert page.sentences == (
        "Edith Varley (1874 – 1951) was an English novelist.",
        "She was born in Marrowby and educated at Girton College.",
        "Her best known novel is The Salt Road (1909).",
        "In Edith Varley, history is recorded locally.",
    )
    assert FakeMediaWiki.log[0] == {
        "action": "query",
        "format": "json",
        "formatversion": "2",
        "prop": "extracts|pageprops",
        "explaintext": "1",
        "ppprop": "disambiguation",
        "redirects": "1",
        "titles": "Edith Varley",
    }
    assert backend.search("edith Varley").title == "Edith Varley"  # MediaWiki capitalises the first letter
    assert backend.search("H. Castellane").title == "Hugh Castellane"  # redirect followed
    # Missing title whose search hit equals it up to case: opened, as the search box's "go" does.
    n = len(FakeMediaWiki.log)
    assert backend.search("Hugh CASTELLANE").title == "Hugh Castellane"
    assert [("titles" in q, q.get("list")) for q in FakeMediaWiki.log[n:]] == [
        (True, None),
        (False, "search"),
        (True, None),
    ]
    # A disambiguation page is not an article: the search hits are the similar titles.
    assert backend.search("Kestrel") == NotFound(
        ("Kestrel", "Kestrel (bird)", "Kestrel (film)", "Anna Orme", "Hugh Castellane")
    )
    assert backend.search("Zzyzx") == NotFound(())
    # Cached: repeating a search asks nothing.
    n = len(FakeMediaWiki.log)
    backend.search("Edith Varley")
    assert len(FakeMediaWiki.log) == n


def test_wikipedia_backend_oracle_episodes(tmp_path: Path, wiki: str):
    doc = _results(
        [
            "--policy",
            "oracle",
            "--task-option",
            "hotpotqa.backend=wikipedia",
            "--task-option",
            f"hotpotqa.wikipedia_url={wiki}",
        ],
        tmp_path,
    )
    metrics = doc["variants"]["original"]["tasks"]["hotpotqa"]
    assert (metrics["success_rate"], metrics["progress_rate"]) == (1.0, 1.0)
    assert any("titles" in q for q in FakeMediaWiki.log)  # the searches went to the loopback API
    # The search observation is the page's first sentences, as from the context backend.
    task = HotpotQATask(str(tmp_path), data=str(FIXTURE), backend="wikipedia", wikipedia_url=wiki)
    local = _env(HotpotQATask(str(tmp_path), data=str(FIXTURE)), "hq-fixture-01")
    remote = _env(task, "hq-fixture-01")
    for title in ("The Salt Road", "Edith Varley"):
        # The same first sentences, then the fake page's later section (fewer than five in all).
        extra = f" In {title}, history is recorded locally."
        assert (
            remote.step(f"search[{title}]").observation == local.step(f"search[{title}]").observation + extra
        )
    assert remote.step("search[Kestrel]").observation == (
        "Could not find Kestrel. Similar: ['Kestrel', 'Kestrel (bird)', 'Kestrel (film)', 'Anna Orme', "
        "'Hugh Castellane']."
    )


def test_wikipedia_backend_errors(wiki: str):
    FakeMediaWiki.fail_next = 1
    assert (
        WikipediaBackend(wiki, timeout=5.0, retries=1).search("Marrowby").title == "Marrowby"
    )  # retried 503
    FakeMediaWiki.fail_next = 5
    with pytest.raises(SearchError, match="failed after 2 attempts: HTTP 503"):
        WikipediaBackend(wiki, timeout=5.0, retries=1).search("Marrowby")
    FakeMediaWiki.fail_next = 0
    with pytest.raises(SearchError, match="answered HTTP 404"):
        WikipediaBackend(wiki.replace("/w/api.php", "/api.php"), retries=0).search("Marrowby")


class Drip(BaseHTTPRequestHandler):
    """Headers at once, then one byte every 0.2 s: each read is quick, the whole answer is not."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        for _ in range(25):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)


def test_wikipedia_request_has_an_overall_deadline():
    with _serving(Drip) as port:
        backend = WikipediaBackend(f"http://127.0.0.1:{port}/w/api.php", timeout=1.0, retries=0)
        t0 = time.monotonic()
        with pytest.raises(SearchError, match="within the 1 s deadline"):
            backend.search("Marrowby")
        assert time.monotonic() - t0 < 2.5
