"""Grammars built in Python: JSON Schema, a regex subset and number ranges turned into GBNF."""
