"""Grouped GEMM (forward, dgrad, wgrad) against a float64 per-expert loop. On CUDA with bf16
this exercises torch._grouped_mm (sm90+); on CPU the loop path."""
import pytest
import torch

from etp.gemm import DenseGemm, GroupedGemm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference(x, w, gy, counts):
    x, w, gy = x.double(), w.double(), gy.double()
    ys, dxs, dws = [], [], []
    for e, (xe, ge) in enumerate(zip(torch.split(x, counts), torch.split(gy, counts))):
        ys.append(xe @ w[e].t())
        dxs.append(ge @ w[e])
        dws.append(ge.t() @ xe)
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[16, 0, 48, 8], [64]])
def test_grouped_gemm_matches_float64_loop(device, dtype, counts):
    gen = torch.Generator().manual_seed(0)
    E, out_f, in_f = len(counts), 96, 64
    x = torch.randn(sum(counts), in_f, generator=gen).to(device, dtype)
    w = torch.randn(E, out_f, in_f, generator=gen).to(device, dtype)
    gy = torch.randn(sum(counts), out_f, generator=gen).to(device, dtype)
    c = torch.tensor(counts)
    y_ref, dx_ref, dw_ref = _reference(x, w, gy, counts)
    dw = torch.empty(E, out_f, in_f, device=device, dtype=dtype)
    GroupedGemm.wgrad(gy, x, c, out=dw)
    # bf16 products are exact in fp32 accumulation; the output rounding is 2^-8 relative.
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(GroupedGemm.forward(x, w, c).double().cpu(), y_ref.cpu(), **tol)
    torch.testing.assert_close(GroupedGemm.dgrad(gy, w, c).double().cpu(), dx_ref.cpu(), **tol)
    torch.testing.assert_close(dw.double().cpu(), dw_ref.cpu(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_wgrad_into_wider_buffer(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=gen).to(device, torch.bfloat16)
    gy = torch.randn(3, 5, 4, generator=gen).to(device, torch.bfloat16)
    out = torch.empty(4, 8, device=device, dtype=torch.float32)  # fp32 main-grad-style buffer
    DenseGemm.wgrad(gy, x, None, out=out)
    ref = gy.double().reshape(-1, 4).t() @ x.double().reshape(-1, 8)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=2e-2, atol=1e-1)
