"""AgentBoard protocol pieces against hand-computed expectations: checkout reading, prompt assembly, history
truncation, the action parser."""

from __future__ import annotations

import pytest
from agentboard_fixture import make_checkout, write

from agentrefine_jax.eval.agentboard.checkout import Checkout, CheckoutError
from agentrefine_jax.eval.agentboard.protocol import (
    PromptSet,
    PromptTooLong,
    fit_history,
    load_prompt_set,
    parse_action,
    prompt_head,
    user_prompt,
    vllm_system_suffix,
)

HELP = "You should use the following commands for help when your action cannot be understood: "


def test_missing_file_is_one_line_naming_path_and_download(tmp_path):
    co = Checkout(make_checkout(tmp_path, pddl=False))
    with pytest.raises(CheckoutError) as e:
        co.read_jsonl("data/babyai/test.jsonl")
    msg = str(e.value)
    assert "\n" not in msg
    assert str(tmp_path / "data/babyai/test.jsonl") in msg and "data.tar.gz" in msg
    with pytest.raises(CheckoutError, match="git clone"):
        co.read_json("agentboard/prompts/VanillaAgent/babyai_vanilla_prompt.json")
    with pytest.raises(CheckoutError, match="not a directory"):
        Checkout(tmp_path / "nowhere")


def test_literals_and_config_are_read_without_importing(tmp_path):
    root = make_checkout(tmp_path)
    # A file whose import would fail: only its literal may be read.
    write(root, "agentboard/tasks/broken.py", "import does_not_exist\nTABLE = {'a': [1, 2]}\n")
    co = Checkout(root)
    assert co.literal("agentboard/tasks/broken.py", "TABLE") == {"a": [1, 2]}
    # Duplicate keys: the last one wins, as when AgentBoard's module is imported.
    pmap = co.literal("agentboard/environment/pddl_env/pddl_env.py", "predicate_map")
    assert pmap["free"] == "{} is free."
    assert co.env_config("pddl")["game_name"] == ["gripper"]
    assert co.env_config("scienceworld")["check_inventory"] is True
    with pytest.raises(CheckoutError, match="no top-level `MISSING"):
        co.literal("agentboard/tasks/broken.py", "MISSING")
    write(root, "data/x/test.jsonl", '{"a": 1}\nnot json\n')
    with pytest.raises(CheckoutError, match=r"test.jsonl:2: not valid JSON"):
        co.read_jsonl("data/x/test.jsonl")


def test_vllm_sentence_is_read_from_the_checkout(tmp_path):
    assert vllm_system_suffix(Checkout(make_checkout(tmp_path))) == "Answer with one action. "


def test_prompt_assembly_matches_agentboard_layout(tmp_path):
    co = Checkout(make_checkout(tmp_path))
    ps = load_prompt_set(co, "agentboard/prompts/VanillaAgent/pddl_vanilla_prompt.json", "gripper")
    assert ps == PromptSet(
        "Move balls with a two-armed robot.", ("Goal: ball in b\nAction: move a b",), "You plan."
    )
    head = prompt_head(ps, "G", "check valid actions", False)
    assert head == (
        "Move balls with a two-armed robot.\nHere are examples:\nGoal: ball in b\nAction: move a b\n"
        "You should perform actions to accomplish the goal: G\n" + HELP + "check valid actions\n"
    )
    memory = [("Observation", "o0"), ("Action", "a1"), ("Observation", "o1")]
    prompt, dropped = fit_history(head, memory, lambda _u: True)
    assert dropped == 0
    assert prompt == head + "Observation: o0\nAction: a1\nObservation: o1\nAction: "

    # A string `examples` is one example; check_inventory adds the fixed `inventory` line.
    sw = load_prompt_set(co, "agentboard/prompts/VanillaAgent/scienceworld_base.json", None)
    assert sw.examples == ("ACTION: look around",)
    assert prompt_head(sw, "boil", "check valid actions", True).endswith(
        "goal: boil\n" + HELP + "check valid actions\n" + HELP + "inventory\n"
    )
    # No examples: no examples header; no help command: no help line.
    assert (
        prompt_head(PromptSet("I.", (), "s"), "G", None, False)
        == "I.You should perform actions to accomplish the goal: G\n"
    )


def test_alfworld_style_example_sets_are_joined(tmp_path):
    root = make_checkout(tmp_path)
    write(
        root,
        "agentboard/prompts/VanillaAgent/alfworld_base.json",
        '{"instruction": "I", "system_msg": "S", "examples": {"put": ["a\\n", "b"], "heat": ["c"]}}',
    )
    ps = load_prompt_set(Checkout(root), "agentboard/prompts/VanillaAgent/alfworld_base.json", "put")
    assert ps.examples == ("a\nb",)
    with pytest.raises(CheckoutError, match="no example set `cool`"):
        load_prompt_set(Checkout(root), "agentboard/prompts/VanillaAgent/alfworld_base.json", "cool")


def test_truncation_drops_oldest_history_lines_until_it_fits():
    head = "HEAD\n"
    memory = [("Observation", "o" * 10)] + [
        (k, str(i)) for i in range(1, 5) for k in ("Action", "Observation")
    ]
    lines = [f"{k}: {t}" for k, t in memory]
    full = user_prompt(head, lines)

    # Budget: the prompt without the first three history lines fits, with only two dropped it does not.
    budget = len(user_prompt(head, lines[3:]))
    assert len(user_prompt(head, lines[2:])) > budget
    prompt, dropped = fit_history(head, memory, lambda u: len(u) <= budget)
    assert dropped == 3
    assert prompt == head + "\n".join(lines[3:]) + "\nAction: "
    assert prompt.startswith(head)  # instruction, examples, goal are never cut
    assert fit_history(head, memory, lambda u: len(u) <= len(full)) == (full, 0)
    # Everything dropped still fits: an empty history.
    assert fit_history(head, memory, lambda u: len(u) <= len(head) + 10) == (head + "\nAction: ", len(memory))
    with pytest.raises(PromptTooLong):
        fit_history(head, memory, lambda u: len(u) < len(head))
    # memory_size keeps only the newest items before any token count.
    prompt, dropped = fit_history(head, memory, lambda _u: True, memory_size=2)
    assert (prompt, dropped) == (head + "Action: 4\nObservation: 4\nAction: ", 7)


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("Thought: go\nAction: stack b1 on b2", "stack b1 on b2"),
        ("pick up key 1\nmore text", "pick up key 1"),
        ("Action: 'go to red ball 1'/", "go to red ball 1"),
        ("The best action is to open door", "open door"),
        ("Here is the next action:\n\nmove rooma roomb\nthen more", "move rooma roomb"),
        ("Action:\ncheck valid actions", "Action:"),  # empty after ':' and no rule for the next line
        ("Search with Action Input: x\nAction: y", "Search with Action Input: x"),
        ("ACTION:  look around  \nOBSERVATION: ...", "look around"),
        ("", ""),
        ("  \n  go north\nwest", "go north"),  # stripped before the first line is kept
    ],
)
def test_action_parser(reply, action):
    assert parse_action(reply) == action


@pytest.mark.timeout(300)
def test_truncation_boundary_counts_what_agentboards_vllm_wrapper_counts():
    """AgentBoard's vLLM wrapper counts `len(tokenizer(full_prompt)["input_ids"])`: the templated text
    tokenized again, which puts the tokenizer's BOS in front of the template's own. A prompt of exactly the
    budget keeps its whole history; one token more drops the oldest history item."""
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer
    from agentrefine_jax.eval.agentboard.runner import TemplateModel

    tok = load_tokenizer("llama3")
    template = get_template("llama3", tok)
    system, head = "You plan.", "Move balls.\nYou should perform actions to accomplish the goal: G\n"
    memory = [("Observation", "You are in room a."), ("Action", "move a b"), ("Observation", "Moved.")]
    full = user_prompt(head, [f"{k}: {t}" for k, t in memory])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": full}]
    text = template.decode(template.encode_prompt(messages), skip_special_tokens=False)
    assert text.startswith("<|begin_of_text|>")
    agentboard_count = len(tok(text)["input_ids"])  # what AgentBoard's num_tokens_from_messages returns
    assert agentboard_count == len(template.encode_prompt(messages)) + 1  # the re-tokenisation's extra BOS

    def fits(model):  # AgentBoard's test: tokens(system + user) <= context_length - max_tokens
        return lambda user: model.num_tokens(system, user) <= model.context_length - model.max_tokens

    exact = TemplateModel("m", template, agentboard_count + 100, actor=None)  # budget = context - 100
    assert exact.num_tokens(system, full) == agentboard_count
    assert fit_history(head, memory, fits(exact)) == (full, 0)
    short = TemplateModel("m", template, agentboard_count + 99, actor=None)
    prompt, dropped = fit_history(head, memory, fits(short))
    assert dropped == 1 and prompt == user_prompt(head, ["Action: move a b", "Observation: Moved."])
