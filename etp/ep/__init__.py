"""Expert parallelism: move tokens to the ranks holding their experts and back.

See ``docs/ep.md``. Public API::

    from etp import ep
    cfg = ep.EPConfig(num_experts=128, topk=8, hidden_size=4096, max_tokens_per_rank=32768)
    disp = ep.ExpertDispatcher(cfg, group)
    handle = disp.prepare(topk_idx)
    recv_x, recv_w, tokens_per_expert = disp.dispatch(x, topk_weights, handle)
    out = disp.combine(expert_out, handle)
"""
from etp.ep import profiler as _profiler
from etp.ep.backends import ALL_BACKENDS, available_backends
from etp.ep.config import EPConfig
from etp.ep.dispatcher import ExpertDispatcher
from etp.ep.handle import EPHandle, HandleState


def profile(cfg: EPConfig, group=None, **kwargs) -> tuple[str, str]:
    """Times every available backend on ``cfg``'s workload and returns the fastest
    ``(dispatch, combine)`` pair; see ``etp.ep.profiler.profile`` for the options.

    Example::

        dispatch_name, combine_name = ep.profile(cfg, group)
    """
    kwargs.setdefault("dispatcher_cls", ExpertDispatcher)
    return _profiler.profile(cfg, group, **kwargs)

__all__ = ["ALL_BACKENDS", "EPConfig", "EPHandle", "ExpertDispatcher", "HandleState", "available_backends",
           "profile"]
