"""etp.jax: JAX counterparts of etp's torch APIs; imports nothing from torch.

Installed with the ``jax`` extra (``pip install -e ".[jax]"``). Subpackages:

* :mod:`etp.jax.ep`: expert parallelism (MoE token dispatch / combine) inside
  ``shard_map``. See ``docs/jax.md``.

Example::

    from etp.jax import ep as jep
"""
try:
    # ``jax.numpy`` as well as ``jax``: any directory named ``jax`` on sys.path imports as an
    # empty namespace package when the real JAX is missing; only the submodule import fails then.
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without JAX
    raise ImportError('etp.jax needs JAX: pip install -e ".[jax]"') from err
