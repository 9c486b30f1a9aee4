"""``etp.kernels.embedding_backward`` (deterministic, capture-safe embedding gradient) under the
Triton interpreter against an ordered fp32 loop (bit for bit) and float64 ``F.embedding``."""
import pytest
import torch
import torch.nn.functional as F

from etp.kernels import embedding_backward
from etp.kernels.embedding import embedding_backward_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on CPU

CASES = [  # (ids shape, vocabulary rows, hidden, id range)
    ((3, 17), 11, 8, 11),    # repeated ids, every row hit
    ((2, 9), 40, 5, 40),     # rows never hit (zeros), hidden not a power of two
    ((4, 6), 7, 12, 1),      # every token the same id
    ((1,), 5, 3, 5),         # one token
    ((0,), 6, 4, 6),         # no tokens: all zeros
    ((2, 3), 4, 1100, 4),    # hidden wider than one column block
]


@pytest.mark.parametrize("shape,rows,hidden,span", CASES)
def test_ordered_sums_bit_for_bit_and_float64_close(shape, rows, hidden, span):
    g = torch.Generator().manual_seed(sum(shape) + rows)
    ids = torch.randint(0, span, shape, generator=g).to(DEVICE)
    grad = torch.randn(*shape, hidden, generator=g).to(DEVICE)
    got = embedding_backward(ids, grad, rows, impl="triton")
    assert got.dtype == torch.float32 and got.shape == (rows, hidden)
    # The same fp32 additions in the same (token) order: equal bit for bit.
    assert torch.equal(got, embedding_backward_reference(ids, grad, rows))
    weight = torch.zeros(rows, hidden, dtype=torch.float64, device=DEVICE, requires_grad=True)
    (F.embedding(ids, weight) * grad.double()).sum().backward()
    torch.testing.assert_close(got.double(), weight.grad, rtol=1e-5, atol=1e-5)
    if ids.numel():
        hit = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
        hit[ids.reshape(-1)] = True
        assert torch.all(got[~hit] == 0)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_half_precision_gradients_sum_in_float32(grad_dtype, ids_dtype):
    # What training hands it: bf16 output gradients; each row is widened, then added in fp32.
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 13, (3, 21), generator=g).to(ids_dtype).to(DEVICE)
    grad = torch.randn(3, 21, 37, generator=g).to(grad_dtype).to(DEVICE)
    got = embedding_backward(ids, grad, 13, impl="triton")
    assert got.dtype == torch.float32
    assert torch.equal(got, embedding_backward_reference(ids, grad, 13))
    weight = torch.zeros(13, 37, dtype=torch.float64, device=DEVICE, requires_grad=True)
    (F.embedding(ids.long(), weight) * grad.double()).sum().backward()
    torch.testing.assert_close(got.double(), weight.grad, rtol=1e-5, atol=1e-5)


def test_float64_gradients_accumulate_in_float64():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (4, 7), generator=g).to(DEVICE)
    grad = torch.randn(4, 7, 6, dtype=torch.float64, generator=g).to(DEVICE)
    got = embedding_backward(ids, grad, 5, impl="triton")
    weight = torch.zeros(5, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    (F.embedding(ids, weight) * grad).sum().backward()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, weight.grad, rtol=1e-12, atol=1e-12)


def test_bad_input_names_the_argument():
    ids, grad = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="ids"):
        embedding_backward(ids.float(), grad, 5)
    with pytest.raises(ValueError, match="grad"):
        embedding_backward(ids, grad[:, :2], 5)
    with pytest.raises(ValueError, match="num_rows"):
        embedding_backward(ids, grad, 0)


def test_capture_safe_embedding_takes_the_ordered_sums_in_deterministic_mode(monkeypatch):
    import etp.train.captured_step as graph_step
    from etp.train.captured_step import _CaptureSafeEmbedding

    calls = []
    original = graph_step.embedding_backward
    monkeypatch.setattr(graph_step, "embedding_backward", lambda *a: (calls.append(1), original(*a))[1])

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 9, (2, 13), generator=g).to(DEVICE)
    weight = torch.randn(9, 4, generator=g).to(DEVICE).requires_grad_(True)
    grad = torch.randn(2, 13, 4, generator=g).to(DEVICE)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        (_CaptureSafeEmbedding.apply(ids, weight) * grad).sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert calls == [1]  # the ordered sums, not index_add_ (whose CUDA path adds with atomics)
    assert torch.equal(weight.grad, embedding_backward_reference(ids, grad, 9))
