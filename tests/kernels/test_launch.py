"""etp.kernels.launch: the cached Triton launches ([Note: cached launches]).

On CPU the key logic is checked directly (what must make two launches use different compiled
kernels, and what must not), and launches under the interpreter go through Triton. On a GPU
(compiled Triton), the compiled kernel a cached launch uses is checked against the one
Triton's own launch picks, over the argument patterns etp's kernels meet (aligned and
misaligned pointers, ints equal to 1, multiples of 16 and not), and the cached path's
results against the pure-torch reference.
"""
from __future__ import annotations

import pytest
import torch

from etp.kernels import launch as launch_mod
from etp.kernels.amax import interpreter_active
from etp.kernels.launch import _spec, launch, launch_stats
from etp.kernels.transpose import _TILE, _transpose_kernel

ON_GPU = torch.cuda.is_available() and not interpreter_active()
CHECKED = launch_mod._VERSION in launch_mod._CHECKED


def test_spec_separates_what_triton_specializes_on():
    a = torch.zeros(64, dtype=torch.uint8)
    # Pointer alignment (16 bytes) and dtype.
    assert _spec(a, False) != _spec(a[1:], False)
    assert _spec(a, False) == _spec(a[16:], False)
    assert _spec(a, False) != _spec(a.view(torch.int8), False)
    # Ints: == 1, divisibility by 16, 32 / 64-bit range.
    assert len({_spec(v, False) for v in (1, 16, 17, 2**31, 2**63)}) == 5
    assert _spec(32, False) == _spec(48, False) and _spec(3, False) == _spec(5, False)
    # bools by value; floats by type (a float argument is not specialized, so a new value
    # must not make a new cache entry per call).
    assert _spec(True, False) != _spec(False, False)
    assert _spec(0.5, False) == _spec(3.0, False)
    # constexprs by value, whatever their type.
    assert _spec(3.0, True) != _spec(0.5, True) and _spec(64, True) != _spec(128, True)


def test_tail_orders_keywords_and_defaults():
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def body(x_ptr, n, SCALE: tl.constexpr = 2, FLAG: tl.constexpr = False):
        pass

    # A compiled-Triton function object (triton.jit makes an interpreted one under the
    # interpreter, which launch never binds): made directly, nothing is compiled.
    info = launch_mod._Kernel(JITFunction(body))
    assert info.constexpr == (False, False, True, True)
    # Parameters after the positional ones: a keyword's value or the default, in order; the
    # launch options (num_warps) are not parameters.
    assert info.tail(1, {"FLAG": True, "n": 7, "num_warps": 4}) == (7, 2, True)
    assert info.tail(2, {}) == (2, False)
    with pytest.raises(TypeError, match="'n' has no value"):
        info.tail(1, {})


def test_wrapped_kernels_go_through_triton():
    # A wrapper around a kernel (tests count launches with one) is launched through Triton's
    # own path: only a JITFunction's parameters can be bound.
    seen = []

    class Wrapper:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((grid, args, meta))

    before = launch_stats()["triton"]
    launch(Wrapper(), (3,), 1, 2, TILE=4)
    assert seen == [((3,), (1, 2), {"TILE": 4})] and launch_stats()["triton"] == before + 1


def test_runtime_arguments_by_keyword_are_refused():
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def body(x_ptr, n, BLOCK: tl.constexpr = 4):
        pass

    info = launch_mod._Kernel(JITFunction(body))
    info.check_keywords(("BLOCK", "num_warps"))  # constexprs and launch options: fine
    with pytest.raises(ValueError, match=r"\['n'\] passed by keyword"):
        info.check_keywords(("n", "BLOCK"))


@pytest.mark.skipif(not interpreter_active(), reason="the interpreter path (TRITON_INTERPRET=1)")
def test_interpreted_launches_go_through_triton():
    x = torch.arange(64 * 64, dtype=torch.uint8).reshape(1, 64, 64)
    y = torch.empty_like(x)
    before = launch_stats()
    for _ in range(2):
        launch(_transpose_kernel, (1, 1, 1), x, y, 64, 64, TILE=_TILE, num_warps=4)
    after = launch_stats()
    assert after["triton"] - before["triton"] == 2 and after["fast"] == before["fast"]
    assert torch.equal(y[0], x[0].t())


@pytest.mark.skipif(not ON_GPU or not CHECKED, reason="compiled Triton on CUDA, a Triton in launch._CHECKED "
                    "(an unchecked one is served by Triton's own launch)")
def test_cached_launch_uses_the_kernel_triton_picks():
    # A pointer moved by 1..15 bytes, row / column counts of 1, 16, and neither: every
    # specialization Triton may make for this kernel's arguments. For each pattern the
    # cached launch must return (and run) the compiled kernel Triton's own launch returns.
    base = torch.randint(0, 255, (4096 + 64,), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(base)
    for offset in (0, 1, 16):
        for rows, cols in ((1, 16), (16, 1), (16, 32), (17, 33), (64, 48), (3, 5)):
            x = base[offset: offset + rows * cols].view(1, rows, cols)
            y = out[offset: offset + rows * cols].view(1, cols, rows)
            grid = (-(-rows // _TILE), -(-cols // _TILE), 1)
            for _ in range(2):  # the second launch takes the cached path
                y.zero_()
                mine = launch(_transpose_kernel, grid, x, y, rows, cols, TILE=_TILE, num_warps=4)
                torch.testing.assert_close(y[0], x[0].t(), rtol=0, atol=0)
            theirs = _transpose_kernel[grid](x, y, rows, cols, TILE=_TILE, num_warps=4)
            assert mine is theirs, (offset, rows, cols)


@pytest.mark.skipif(not ON_GPU, reason="compiled Triton on CUDA")
def test_cached_launches_compute_what_the_references_do():
    from etp.kernels import quantize_rowwise, transpose_last2
    from etp.kernels.reference import quantize_blockwise_ref

    before = launch_stats()["fast"]
    for rows, cols in ((1, 16), (5, 100), (64, 4096), (3, 32000)):
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        q_ref, s_ref = quantize_blockwise_ref(x, 1, cols)
        for _ in range(3):
            q, s = quantize_rowwise(x)
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
            torch.testing.assert_close(s, s_ref.reshape(rows), rtol=0, atol=0)
            w = q.view(torch.uint8)
            assert torch.equal(transpose_last2(w), w.t().contiguous())
    # The cached path serves a checked Triton (another goes through Triton's own launch).
    assert (launch_stats()["fast"] - before >= 8) == CHECKED
