"""Breadth-first planner over the ground actions of a pddlgym problem (the PDDL oracle).

Operators parsed by pddlgym are grounded once per problem over the problem's objects (typed), then
BFS runs over states represented as sets of ground-atom strings. Only STRIPS operators with
conjunctive preconditions/goals are supported, which covers the domains we ship. The plan is
replayed through pddlgym's own transition function by the environment, so any disagreement with
pddlgym's semantics shows up as an oracle failure rather than a silent pass.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any


@dataclasses.dataclass(frozen=True)
class GroundAction:
    literal: Any  # pddlgym Literal of the action, as the environment expects it
    pre: frozenset[str]
    neg_pre: frozenset[str]
    add: frozenset[str]
    delete: frozenset[str]


class UnsupportedDomain(ValueError):
    pass


def conjuncts(struct: Any) -> list[Any]:
    from pddlgym.structs import Literal, LiteralConjunction

    if isinstance(struct, LiteralConjunction):
        out = []
        for lit in struct.literals:
            out.extend(conjuncts(lit))
        return out
    if isinstance(struct, Literal):
        return [struct]
    raise UnsupportedDomain(f"only conjunctions of literals are supported, got {type(struct).__name__}")


def _objects_of_type(objects: list[Any], var_type: Any, parents: dict[Any, set[Any]]) -> list[Any]:
    return [o for o in objects if var_type in parents.get(o.var_type, {o.var_type})]


def ground_actions(env: Any, state: Any) -> list[GroundAction]:
    """All type-consistent groundings of the domain's operators for the objects of `state`."""
    domain = env.domain
    parents = domain.type_to_parent_types
    objects = sorted(state.objects, key=str)
    action_pred_names = {p.name for p in env.action_predicates}
    # Static atoms (never added or deleted) prune the grounding early.
    changing = set()
    for op in domain.operators.values():
        for eff in conjuncts(op.effects):
            changing.add(eff.predicate.name)
    static = {str(lit) for lit in state.literals if lit.predicate.name not in changing}
    static_names = {lit.predicate.name for lit in state.literals} - changing
    static_names |= {p for p in domain.predicates if p not in changing and p not in action_pred_names}
    out = []
    for op in domain.operators.values():
        pre = conjuncts(op.preconds)
        effects = conjuncts(op.effects)
        domains = [_objects_of_type(objects, p.var_type, parents) for p in op.params]
        for combo in itertools.product(*domains):
            subs = dict(zip(op.params, combo, strict=True))
            subs.update((c, c) for c in domain.constants)
            pos, neg, action_lit, ok = set(), set(), None, True
            for lit in pre:
                g = lit.predicate(*[subs[v] for v in lit.variables])
                name = lit.predicate.name
                if name in action_pred_names:
                    action_lit = g.positive if g.is_negative else g
                    continue
                if g.is_negative:
                    neg.add(str(g.positive))
                else:
                    s = str(g)
                    if name in static_names and s not in static:
                        ok = False
                        break
                    pos.add(s)
            if not ok:
                continue
            if action_lit is None:  # operators_as_actions: the operator itself is the action
                pred = next(p for p in env.action_predicates if p.name == op.name)
                action_lit = pred(*combo)
            add, delete = set(), set()
            for eff in effects:
                g = eff.predicate(*[subs[v] for v in eff.variables])
                if g.is_anti:
                    delete.add(str(g.inverted_anti))
                else:
                    add.add(str(g))
            out.append(
                GroundAction(action_lit, frozenset(pos), frozenset(neg), frozenset(add), frozenset(delete))
            )
    return out


def goal_atoms(goal: Any) -> tuple[frozenset[str], frozenset[str]]:
    """(atoms that must hold, atoms that must not hold) of a conjunctive goal."""
    pos, neg = set(), set()
    for lit in conjuncts(goal):
        if lit.is_negative:
            neg.add(str(lit.positive))
        else:
            pos.add(str(lit))
    return frozenset(pos), frozenset(neg)


def bfs_plan(env: Any, state: Any, max_states: int = 200_000) -> list[Any] | None:
    """Shortest plan (list of pddlgym action literals) from `state` to its goal, or None."""
    actions = ground_actions(env, state)
    goal_pos, goal_neg = goal_atoms(state.goal)
    start = frozenset(str(lit) for lit in state.literals)
    parent: dict[frozenset[str], tuple[frozenset[str], Any] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        s = queue.popleft()
        if goal_pos <= s and not (goal_neg & s):
            plan = []
            while parent[s] is not None:
                s, a = parent[s]
                plan.append(a)
            return plan[::-1]
        for a in actions:
            if a.pre <= s and not (a.neg_pre & s):
                ns = (s - a.delete) | a.add
                if ns not in parent:
                    parent[ns] = (s, a.literal)
                    queue.append(ns)
                    if len(parent) > max_states:
                        return None
    return None
