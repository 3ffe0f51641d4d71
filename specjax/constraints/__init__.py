"""Structured output: regex and JSON-schema constraints as token automata
(`specjax.constraints.automaton`)."""
