"""etp.train.profile: the kernel classifier and the per-iteration breakdown on a synthetic
Chrome trace (the format torch.profiler writes), and the profiler schedule."""
import pytest

from etp.train.profile import CLASSES, breakdown, classify_kernel, format_breakdown, profile_schedule


def _range(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _launch(ts, correlation, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 1,
            "tid": tid, "args": {"correlation": correlation}}


def _kernel(name, ts, dur, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"correlation": correlation}}


def _trace():
    events = [
        _range("ProfilerStep#1", 0, 1000, cat="user_annotation"), _range("ProfilerStep#2", 1000, 1000,
                                                                         cat="user_annotation"),
        # torch >= 2.10 also writes each step's span on the GPU's timeline: not another iteration.
        _range("ProfilerStep#1", 100, 500, tid=7, cat="gpu_user_annotation"),
        _range("ProfilerStep#2", 1100, 200, tid=7, cat="gpu_user_annotation"),
        _range("aten::mm", 10, 10), _launch(15, 1), _kernel("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", 100, 200, 1),
        _range("etp::attention", 30, 30, cat="user_annotation"),
        _range("aten::_scaled_dot_product_flash_attention", 35, 20), _launch(40, 2),
        _kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 300, 100, 2),
        _range("aten::sort", 62, 5), _launch(63, 3), _kernel("DeviceRadixSortOnesweepKernel", 400, 50, 3),
        _range("etp::moe_router", 70, 10, cat="user_annotation"), _range("aten::softmax", 71, 5), _launch(72, 4),
        _kernel("cunn_SoftMaxForward<4, float>", 450, 10, 4),
        _range("aten::_log_softmax", 82, 5), _launch(83, 5), _kernel("cunn_SoftMaxForward<4, float, Log>", 460, 10, 5),
        _launch(90, 6, tid=3), _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 350, 250, 6, stream=20),
        _range("etp::optimizer", 1010, 50, cat="user_annotation"), _launch(1020, 7),
        _kernel("multi_tensor_apply_kernel<AdamFunctor>", 1100, 100, 7),
        _range("autograd::engine::evaluate_function: SoftmaxBackward0", 1030, 20, tid=2), _launch(1035, 8, tid=2),
        _kernel("cunn_SoftMaxBackward<4, float>", 1200, 100, 8),
    ]
    return {"traceEvents": events}


def test_breakdown_of_a_synthetic_trace():
    table = breakdown(_trace())
    assert table["iterations"] == 2
    want = {"gemm": 200, "attention": 200, "moe": 60, "elementwise": 10, "optimizer": 100, "communication": 250}
    for key in CLASSES:
        assert table["classes"][key] == pytest.approx(want[key] / 2 / 1000), key
    assert table["wall"] == pytest.approx(2000 / 2 / 1000)
    assert table["busy"] == pytest.approx(700 / 2 / 1000)  # [100, 600] and [1100, 1300]
    assert table["host_gaps"] == pytest.approx(1300 / 2 / 1000)
    assert table["exposed_communication"] == pytest.approx(130 / 2 / 1000)  # 470 .. 600 has no compute
    assert table["top_kernels"][0]["class"] == "communication"
    text = format_breakdown(table, "test")
    assert "host gaps" in text and "attention" in text


def test_classifier_rules():
    assert classify_kernel("ncclDevKernel_ReduceScatter", ["etp::optimizer"]) == "communication"
    assert classify_kernel("_rs_kernel", ["etp::backward", "etp::reduce_scatter"]) == "communication"
    assert classify_kernel("ampere_bf16_s16816gemm", ["aten::baddbmm"]) == "attention"  # local attention scores
    assert classify_kernel("cutlass_80_tensorop_gemm", ["aten::_grouped_mm"]) == "gemm"
    assert classify_kernel("elementwise_kernel", ["aten::index_select"]) == "moe"
    assert classify_kernel("elementwise_kernel", ["aten::add_"]) == "elementwise"
    assert classify_kernel("vectorized_elementwise_kernel", ["etp::finalize", "aten::mul_"]) == "optimizer"


def test_trace_without_steps_uses_the_kernel_span():
    events = [_kernel("gemm_a", 0, 10, 1), _kernel("elementwise_kernel", 20, 10, 2)]
    table = breakdown(events)
    assert table["iterations"] == 1 and table["wall"] == pytest.approx(0.030)
    assert table["host_gaps"] == pytest.approx(0.010)


@pytest.mark.parametrize("iterations", [1, 2, 5, 12, 50])
def test_schedule_records_steady_steps(iterations):
    s = profile_schedule(iterations)
    assert 1 <= s["active"] <= 4 and s["wait"] + s["warmup"] + s["active"] <= iterations


def test_label_modules_wraps_forward_in_a_profiler_range(tmp_path):
    import json

    import torch

    from etp.train.profile import label_modules

    class TopKRouter(torch.nn.Linear):  # named like megatron's router
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), TopKRouter(4, 2))
    handles = label_modules(model)
    assert len(handles) == 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randn(3, 4))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    ranges = [e for e in events if e.get("name") == "etp::moe_router" and e.get("ph") == "X"]
    assert len(ranges) == 1
    inside = [e for e in events if e.get("cat") == "cpu_op" and e.get("name") == "aten::linear"
              and ranges[0]["ts"] <= e["ts"] <= ranges[0]["ts"] + ranges[0]["dur"]]
    assert len(inside) == 1  # the router's linear, not the first one
    for handle in handles:
        handle.remove()


def test_host_activity_counts_launches_and_attributes_syncs():
    from etp.train.profile import host_activity

    def runtime(name, ts, dur):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    events = _trace()["traceEvents"] + [
        _range("aten::item", 500, 300), _range("aten::_local_scalar_dense", 501, 298),
        runtime("cudaMemcpyAsync", 502, 2), runtime("cudaStreamSynchronize", 505, 290),
        _range("aten::nonzero", 1500, 100), runtime("cudaStreamSynchronize", 1510, 80),
    ]
    host = host_activity({"traceEvents": events})
    assert host["iterations"] == 2
    assert host["launches"] == (8 + 1) / 2  # 8 kernel launches and one async memcpy
    assert host["syncs"] == 1.0 and host["sync_ms"] == pytest.approx((290 + 80) / 2e3)
    assert [s["op"] for s in host["sync_sites"]] == ["aten::item", "aten::nonzero"]  # outermost op, busiest first
    assert "host:" in format_breakdown({**breakdown({"traceEvents": events}), "host": host})


def test_training_profiler_writes_python_hotspots(tmp_path):
    import json

    import torch

    from etp.train.profile import TrainingProfiler

    profiler = TrainingProfiler(str(tmp_path), 0, iterations=12, cuda=False)
    assert profiler.python_window == (4, 6)  # just before the torch window (wait 6)
    covered = []
    for step in range(12):
        torch.randn(64, 64).mm(torch.randn(64, 64)).sum().item()
        covered.append(profiler.covers(step))
        profiler.step()
    table = profiler.finish()
    assert covered == [False] * 4 + [True] * 7 + [False]  # cProfile 4-5, torch 6-10
    assert table["host"]["python"] and all("own_ms" in row for row in table["host"]["python"])
    assert "cProfile of 2 iterations" in (tmp_path / "host_rank0.txt").read_text()
    assert json.loads((tmp_path / "breakdown_rank0.json").read_text())["host"]["iterations"] >= 1


def test_kernel_time_plausibility_against_peak():
    from etp.train.profile import kernel_time_plausible

    table = {"classes": {**dict.fromkeys(CLASSES, 0.0), "gemm": 19.6, "attention": 2.7}, "wall": 200.0,
             "busy": 87.0, "host_gaps": 113.0, "exposed_communication": 0.0, "iterations": 8}
    # 26.78 TFLOP in 22.3 ms of GEMM + attention would be 1200 TFLOP/s on a 798 TFLOP/s GPU.
    assert not kernel_time_plausible(table, 26.78e12, 798.0)
    assert kernel_time_plausible(table, 10e12, 798.0)
    assert "misses kernels" in format_breakdown({**table, "kernel_time_plausible": False})
