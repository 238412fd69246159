"""Layer placement on fake device reports: the pure function the loader and `localllm plan` share (fits, spills to
the CPU, does not fit anywhere), and that llama.cpp's own assignment rule gives each device the layers we chose."""

from __future__ import annotations

import pytest

from localllm.models.plan import MARGIN_MIN, DeviceReport, MemoryPlan, layer_devices, place_layers

MIB = 2**20
GIB = 2**30


def _plan(n_layers=10, layer=100 * MIB, kv=10 * MIB, output=50 * MIB, inputs=40 * MIB, compute=20 * MIB):
    return MemoryPlan(
        weights=n_layers * layer + output + inputs,
        adapters=0,
        kv_per_token=0,
        kv_per_slot=0,
        kv_total=n_layers * kv,
        compute=compute,
        num_ctx=4096,
        num_parallel=1,
        kv_type="f16",
        available=None,
        layer_weights=(layer,) * n_layers,
        layer_kv=(kv,) * n_layers,
        input_weights=inputs,
        output_weights=output,
    )


def _device(name, free, total=None, kind="gpu", description=""):
    return DeviceReport(name=name, description=description, kind=kind, free=free, total=total or free)


HOST = _device("CPU", 64 * GIB, kind="cpu")


def test_everything_fits_on_one_gpu():
    placement = place_layers(_plan(), HOST, [_device("CUDA0", 8 * GIB)])
    assert placement.n_gpu_layers == 11  # 10 blocks and the output head
    host, gpu = placement.shares
    assert (host.layers, gpu.layers) == (0, 11)
    assert gpu.weights == 10 * 100 * MIB + 50 * MIB and gpu.kv == 100 * MIB and gpu.compute == 20 * MIB
    assert host.weights == 40 * MIB and host.kv == 0  # the input embedding always stays on the CPU
    assert placement.fits


def test_a_gpu_too_small_takes_the_last_layers_and_the_rest_spills_to_the_cpu():
    # usable = free - margin (256 MiB floor) - compute: room for the head (50) and four blocks of 110 each.
    gpu = _device("CUDA0", MARGIN_MIN + 20 * MIB + 50 * MIB + 4 * 110 * MIB + 5 * MIB)
    placement = place_layers(_plan(), HOST, [gpu])
    host, offload = placement.shares
    assert placement.n_gpu_layers == 5 and offload.layers == 5 and host.layers == 6
    assert host.weights == 6 * 100 * MIB + 40 * MIB and host.kv == 6 * 10 * MIB
    assert offload.total <= gpu.usable and placement.fits
    assert layer_devices(11, placement.n_gpu_layers, placement.tensor_split) == [-1] * 6 + [0] * 5


def test_num_gpu_zero_keeps_everything_on_the_cpu_and_a_set_count_is_obeyed():
    gpu = _device("CUDA0", 8 * GIB)
    assert place_layers(_plan(), HOST, [gpu], num_gpu=0).n_gpu_layers == 0
    forced = place_layers(_plan(), HOST, [gpu], num_gpu=3)
    assert forced.n_gpu_layers == 3 and forced.shares[1].layers == 3 and forced.host.layers == 8
    assert place_layers(_plan(), HOST, [gpu], num_gpu=-1).n_gpu_layers == 11  # -1 is "all that fit", as unset


def test_a_model_that_fits_nowhere_says_so_per_device():
    small_host = _device("CPU", 600 * MIB, total=1 * GIB, kind="cpu")
    tiny_gpu = _device("CUDA0", MARGIN_MIN + 20 * MIB + 60 * MIB)  # room for the head only
    placement = place_layers(_plan(), small_host, [tiny_gpu])
    assert placement.n_gpu_layers == 1
    assert not placement.fits and not placement.host.fits and placement.shares[1].fits


def test_layers_split_across_a_worker_and_a_local_gpu_in_llama_cpp_order():
    # RPC workers come first in llama.cpp's device list, so they take the lower offloaded layers.
    worker = _device("RPC0", MARGIN_MIN + 20 * MIB + 3 * 110 * MIB, kind="rpc", description="10.0.0.2:50052")
    gpu = _device("CUDA0", MARGIN_MIN + 20 * MIB + 50 * MIB + 5 * 110 * MIB)
    placement = place_layers(_plan(), HOST, [worker, gpu])
    assert [(s.device.name, s.layers) for s in placement.shares] == [("CPU", 2), ("RPC0", 3), ("CUDA0", 6)]
    assert placement.n_gpu_layers == 9
    expected = [-1] * 2 + [0] * 3 + [1] * 6
    assert layer_devices(11, placement.n_gpu_layers, placement.tensor_split) == expected


def test_a_device_with_no_room_is_left_out_of_the_list():
    full = _device("CUDA1", MARGIN_MIN, kind="gpu")
    gpu = _device("CUDA0", 8 * GIB)
    placement = place_layers(_plan(), HOST, [full, gpu])
    assert [s.device.name for s in placement.offload] == ["CUDA0"] and placement.n_gpu_layers == 11


def test_margin_is_kept_on_large_devices():
    big = _device("CUDA0", 100 * GIB)
    assert big.margin == 5 * GIB and big.usable == 95 * GIB


@pytest.mark.parametrize(
    "counts", [[1, 1], [3, 7, 1], [40, 41], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [97, 3, 1]]
)
def test_our_split_points_give_llama_cpp_exactly_our_counts(counts):
    from localllm.models.plan import _split_points

    n = sum(counts)
    assigned = layer_devices(n + 5, n, _split_points([float(c) for c in counts]))
    assert assigned[:5] == [-1] * 5
    assert [assigned.count(i) for i in range(len(counts))] == counts
    assert assigned[5:] == sorted(assigned[5:])


def test_workers_are_checked_where_they_are_named_and_count_in_the_load_identity(monkeypatch):
    from localllm import api, config
    from localllm.errors import ConfigError, InvalidInput
    from localllm.models.options import effective_load, validate_options

    assert (
        validate_options(api.LoadOptions, {"rpc": " 10.0.0.2:50052, [::1]:7,10.0.0.2:50052"}).rpc
        == "10.0.0.2:50052,[::1]:7"
    )
    for bad in ("10.0.0.2", "host:0", "host:70000", ":50052"):
        with pytest.raises(InvalidInput, match="option rpc"):
            validate_options(api.LoadOptions, {"rpc": bad})
    monkeypatch.setenv("LOCALLLM_RPC", "10.0.0.2:50052")
    from_env = effective_load(api.LoadOptions())
    assert from_env == effective_load(api.LoadOptions(rpc="10.0.0.2:50052"))  # same workers, same load
    assert from_env != effective_load(api.LoadOptions(rpc=""))  # "" is this machine alone: another load
    monkeypatch.setenv("LOCALLLM_RPC", ",".join(f"h{i}:1" for i in range(config.MAX_RPC_WORKERS + 1)))
    with pytest.raises(ConfigError, match="LOCALLLM_RPC"):
        config.RPC.get()


def test_weights_without_a_plan_leave_the_split_to_llama_cpp():
    from localllm.models.plan import unplanned_placement

    gpu = _device("CUDA0", 8 * GIB)
    assert unplanned_placement(HOST, []).n_gpu_layers == 0
    loose = unplanned_placement(HOST, [gpu])
    assert loose.n_gpu_layers == 999 and loose.tensor_split == ()
    assert [s.device.name for s in loose.offload] == ["CUDA0"]
    assert unplanned_placement(HOST, [gpu], num_gpu=4).n_gpu_layers == 4
