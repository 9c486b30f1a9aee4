"""The expert-stack benchmark's parts (``tools/bench_expert_stack.py`` runs them): the model and
workload (``model``), the variants' table (``variants``), timing (``measure``), gather bandwidth
(``gathers``), traces (``trace``) and tables (``report``)."""
