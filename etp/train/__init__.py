"""etp-train's components: what ``etp.train.main`` (the command line) puts together.

* ``options.py``: ``RunOptions``, what a run was asked for beyond its recipe.
* ``preflight.py``: every check that needs no process group, run in the launching process
  (or once per rank before the process group exists, reported by rank 0 only).
* ``setup.py``: the process group, the device, the model with ETP, the optimizer step.
* ``model_build.py``: the model a recipe describes (megatron-core's GPTModel, or the CPU model).
* ``checkpointing.py``: when to save, saving, resuming, and the save directory's rules.
* ``reporting.py``: log lines, the JSON report, the profiler's and timeline's output.
* ``loop.py``: ``train()``, the loop over iterations that uses all of the above.
* ``launch.py``: CPU ranks spawned on loopback, and errors reported once.
"""
from etp.train.loop import train
from etp.train.options import RunOptions, TrainError

__all__ = ["RunOptions", "TrainError", "train"]
