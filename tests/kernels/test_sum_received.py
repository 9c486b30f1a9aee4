"""The push reduce-scatter's local sum (etp.kernels.sum_received): the Triton kernel against
its pure-torch reference (exactly: the same fp32 operations in the same order) and a float64
reference, in the interpreter on CPU and compiled on a GPU."""
import pytest
import torch

from etp.kernels.sum_received import sum_received

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,cols", [(5, 7), (16, 1000), (0, 4)])
@pytest.mark.parametrize("peers", [0, 1, 3])
@pytest.mark.parametrize("accumulate", [True, False])
def test_sum_received_kernel_matches_reference_and_float64(rows, cols, peers, accumulate):
    gen = torch.Generator().manual_seed(rows + 10 * peers)
    own = torch.randn(rows, cols, generator=gen).to(DEVICE, torch.bfloat16)
    received = torch.randn(peers, rows, cols, generator=gen).to(DEVICE, torch.bfloat16)
    main_grad = torch.randn(rows, cols, generator=gen).to(DEVICE)
    world = peers + 1
    want = sum_received(own, received, main_grad.clone(), world, accumulate, impl="torch")
    got = sum_received(own, received, main_grad.clone(), world, accumulate, impl="triton")
    assert torch.equal(got, want)  # same fp32 operations in the same order: exact
    exact = (own.double() + received.double().sum(0)) / world + (main_grad.double() if accumulate else 0)
    bound = 4 * torch.finfo(torch.float32).eps * (main_grad.double().abs() + exact.abs() + 1)
    assert ((got.double() - exact).abs() <= bound).all()


def test_sum_received_rounds_once_into_a_16_bit_out():
    own = torch.full((3, 2), 1.0, dtype=torch.bfloat16, device=DEVICE)
    received = torch.full((1, 3, 2), 2.0 ** -9, dtype=torch.bfloat16, device=DEVICE)  # below bf16's ulp at 1
    out = torch.empty(3, 2, dtype=torch.bfloat16, device=DEVICE)
    # 1 + 4 * 2^-9 = 1 + 2^-7 exactly; added one at a time in bf16 every term would vanish.
    sum_received(own, torch.cat([received] * 4), out, impl="triton")
    assert torch.equal(out.cpu(), torch.full((3, 2), 1.0 + 2.0 ** -7, dtype=torch.bfloat16))


def test_sum_received_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must be"):
        sum_received(torch.zeros(2, 3), torch.zeros(1, 3, 3), torch.zeros(2, 3), impl="torch")
