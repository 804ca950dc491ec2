"""The reliability suite's parts, shared by ``scripts/reliability.py`` (the long runs and the
RELIABILITY.md report) and ``tests/test_reliability.py`` (the short runs in CI).

- ``children``: runs cases in child processes, many per child, and pins a signal death or a
  hang on one case (the case in flight, confirmed alone);
- ``child``: the child's side (``python -m reliability_kit.child``);
- ``lifecycle``: generated sequences of operations on handles, Llama objects and streams;
- ``tampered``: variants of a GGUF file's header (and a few of its data);
- ``inputs``: generated grammars, JSON Schemas and chat templates;
- ``sections``: the sections with their short (CI) and long sizes, and replaying a case;
- ``repo``: the repository's scripts/ modules, imported by path.

Not a package anyone installs: both entry points put ``tests/`` on ``sys.path``.
"""
