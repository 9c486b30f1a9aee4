"""etp.kernels.gather_sum ([Note: fused gather-sum]): the Triton kernel bit for bit against its
pure-torch reference, and both against a float64 sum (exact for K bf16 rows summed in fp32,
rounded once), on strided rows and ragged tails; in the interpreter on CPU, compiled on a GPU."""
import pytest
import torch

from etp.kernels import gather_sum as gs
from etp.kernels.gather_sum import gather_sum, gather_sum_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens, topk, columns, dtype, seed, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    inverse = torch.randperm(tokens * topk, generator=g).to(DEVICE)
    wide = torch.randn(tokens * topk, columns + row_pad, generator=g).to(DEVICE, dtype)
    return wide[:, :columns], inverse  # row_pad > 0: rows of a wider buffer (a strided view)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,topk,columns,row_pad", [(7, 3, 33, 0), (gs._TOKENS, 1, gs._COLUMNS, 0),
                                                          (9, 8, gs._COLUMNS + 5, 3)])
def test_kernel_matches_reference_bit_for_bit(dtype, tokens, topk, columns, row_pad):
    rows, inverse = _case(tokens, topk, columns, dtype, tokens + topk, row_pad)
    got = gather_sum(rows, inverse, topk, impl="triton")
    want = gather_sum_reference(rows, inverse, topk)
    assert got.shape == (tokens, columns) and got.dtype == dtype
    assert torch.equal(got, want)


def test_bf16_rows_are_summed_exactly_and_rounded_once():
    rows, inverse = _case(11, 4, 40, torch.bfloat16, 5)
    exact = rows.double().index_select(0, inverse).view(11, 4, 40).sum(1)
    for impl in ("triton", "torch"):
        assert torch.equal(gather_sum(rows, inverse, 4, impl=impl), exact.float().to(torch.bfloat16))


def test_bad_shapes_name_them():
    with pytest.raises(ValueError, match="multiple of topk=3"):
        gather_sum(torch.zeros(4, 2, device=DEVICE), torch.arange(4, device=DEVICE), 3)
