"""``tools/reproduce.py``'s parts: the steps (``steps``: one per table of BENCHMARKS.md), their
headline figures (``headlines``) and the budgeted execution (``runner``)."""
