"""Structured output: regex and JSON-schema constraints as token automata
(`automaton`), the arrays the compiled loop reads (`loop`) and a prompt set's constraints
on the host (`sets`). docs/structured.md."""

from specjax.constraints.automaton import TokenAutomaton, compile_regex, regex_from_json_schema
from specjax.constraints.loop import Constraint, build_constraint
from specjax.constraints.sets import ConstrainedIds, ConstraintSet, compile_cached, regex_of

__all__ = ["ConstrainedIds", "Constraint", "ConstraintSet", "TokenAutomaton",
           "build_constraint", "compile_cached", "compile_regex", "regex_from_json_schema",
           "regex_of"]
