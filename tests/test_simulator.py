"""The simulator's inputs and arithmetic against independent oracles: torch's FLOP counter on the
very static methods we export, the parameter count of the loaded model, hand-worked rooflines,
acceptance counted from a trace by hand, and the adaptive runtime's own choice of depth."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from edgemtp.cli import main
from edgemtp.devices.calibrate.host import resident_size
from edgemtp.devices.calibrate.measure import (
    ATTENTION_SHAPES,
    RESIDENT_LINEARS,
    fit_attention,
    fit_gemm,
)
from edgemtp.devices.profiles import DelegateProfile, load_profile
from edgemtp.devices.simulator import (
    RESIDENT_PROBE_MB,
    call_seconds,
    call_terms,
    float_linear_flops,
    host_call_us,
    kernel_step_bits,
    linear_weights,
    mean_acceptance,
    model_from_preset,
    portable_elements,
    q4_0_kernel,
    simulate,
    trace_acceptance,
)
from edgemtp.errors import EdgeMTPError
from edgemtp.export.forms import EXPORT
from edgemtp.model.config import parse_text_config
from edgemtp.model.cost import (
    Work,
    draft_work,
    forward_work,
    kv_read_bytes,
    layer_weights,
    static_cache_keys,
)
from edgemtp.model.static import StaticBundle, StaticShapes
from edgemtp.model.synth import preset_config, write_preset
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.adaptive import AdaptiveDepth
from edgemtp.runtime.generate import Step

SHAPES = StaticShapes(max_context=96, max_draft=3, chunk=8, context_buckets=(24,))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    target = load_target(write_preset("tiny", root / "t", init_std=0.05))
    drafter = load_drafter(write_preset("tiny-assistant", root / "a", init_std=0.05), target.cfg)
    return target, drafter


def _mv_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1]  # the counter has no formula for a matrix-vector product


def _counted(module, inputs) -> int:
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.mv: _mv_flops})
    with torch.no_grad(), counter:
        module(*inputs)
    return counter.get_total_flops()


def test_method_flops_equal_torch_flop_counter(pair):
    """Every exported method's matmul FLOPs, bucketed ones included, as torch counts them on the
    eager static methods (the graphs `export` lowers)."""
    target, drafter = pair
    bundle = StaticBundle.build(target.model, drafter.model, SHAPES, EXPORT)
    cfg, slots = target.cfg, bundle.cache.slots
    whole, bucket = static_cache_keys(slots), static_cache_keys(slots, 24)
    expected = {
        "prefill_intermediate": forward_work(cfg, range(8), 0, 0, 4.5, whole).flops,
        "prefill_final": forward_work(cfg, range(8), 1, 1, 4.5, whole).flops,
        "prefill_intermediate_ctx24": forward_work(cfg, range(8), 0, 0, 4.5, bucket).flops,
        "prefill_final_ctx24": forward_work(cfg, range(8), 1, 1, 4.5, bucket).flops,
        "verify_0": forward_work(cfg, range(1), 1, 1, 4.5, whole).flops,
        "verify_3": forward_work(cfg, range(4), 4, 4, 4.5, whole).flops,
        "verify_0_ctx24": forward_work(cfg, range(1), 1, 1, 4.5, bucket).flops,
        "verify_3_ctx24": forward_work(cfg, range(4), 4, 4, 4.5, bucket).flops,
        "draft_step": draft_work(drafter.cfg, cfg, 1, 4.5, whole).flops,
        "draft_step_ctx24": draft_work(drafter.cfg, cfg, 1, 4.5, bucket).flops,
    }
    methods = bundle.methods()
    assert set(methods) == set(expected)
    for name, (module, inputs) in methods.items():
        assert _counted(module, inputs) == expected[name], name


class _SoftmaxElements(TorchDispatchMode):
    """Counts the elements every softmax of a call runs over: the attention scores."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten._softmax.default, torch.ops.aten.softmax.int):
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


def test_method_scores_equal_the_elements_softmax_runs_over(pair):
    """Attention scores per call (head x row x key read) as the exported methods' softmaxes see
    them, on the eager static methods (the drafter's head has a softmax-free top-k)."""
    target, drafter = pair
    bundle = StaticBundle.build(target.model, drafter.model, SHAPES, EXPORT)
    cfg, whole = target.cfg, static_cache_keys(bundle.cache.slots)
    expected = {
        "prefill_final": forward_work(cfg, range(8), 1, 1, 4.5, whole).scores,
        "verify_3": forward_work(cfg, range(4), 4, 4, 4.5, whole).scores,
        "draft_step": draft_work(drafter.cfg, cfg, 1, 4.5, whole).scores,
    }
    methods = bundle.methods()
    for name, want in expected.items():
        module, inputs = methods[name]
        counter = _SoftmaxElements()
        with torch.no_grad(), counter:
            module(*inputs)
        assert want > 0 and counter.elements == want, name


def test_weights_per_call_equal_the_model_parameters(pair):
    """Weight bytes of a verify call = every linear of the loaded target (and the LM head) at the
    scheme's bits; a drafter step = the drafter's linears, its head rows as clustered."""
    target, drafter = pair
    cfg = target.cfg
    linear = sum(m.weight.numel() for m in target.model.modules() if isinstance(m, torch.nn.Linear))
    assert forward_work(cfg, range(1), 1, 1, 8.0).weight_bytes == linear
    assert sum(layer_weights(cfg, s) for s in cfg.layers) < linear  # the head is on top
    d = drafter.model
    body = sum(m.weight.numel() for n, m in d.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head")  # fmt: skip
    a = drafter.cfg
    kept = a.centroid_top_k * a.tokens_per_centroid * a.text.hidden_size
    assert draft_work(a, cfg, 5, 8.0).weight_bytes == body + kept
    full = draft_work(a, cfg, 5, 8.0, full_head=True).weight_bytes
    assert full == body + a.text.vocab_size * a.text.hidden_size
    # activation elements: each linear's inputs and outputs, one row through every one
    ends = sum(m.in_features + m.out_features for m in target.model.modules()
               if isinstance(m, torch.nn.Linear))  # fmt: skip
    assert forward_work(cfg, range(1), 1, 1, 8.0).linear_elements == ends
    assert forward_work(cfg, range(5), 5, 5, 8.0).linear_elements == 5 * ends
    drafter_ends = sum(m.in_features + m.out_features for m in d.modules()
                       if isinstance(m, torch.nn.Linear))  # fmt: skip
    assert draft_work(a, cfg, 5, 8.0, full_head=True).linear_elements == drafter_ends
    # the denominator of a bundle's stored bits per weight: every linear of both programs
    every = sum(m.weight.numel() for m in d.modules() if isinstance(m, torch.nn.Linear))
    assert linear_weights(cfg, a) == linear + every


def test_a_pruned_prefills_few_row_linears_are_its_shared_layers_and_head(pair):
    """The final chunk of a pruned prefill runs the KV-shared layers (and the last owning
    layer but for its K/V projections) and the head on its last row only: those weights, summed
    from the loaded target's own modules, are its few-row part, and their FLOPs are one row's."""
    target, _ = pair
    cfg = target.cfg
    work = forward_work(cfg, range(8), 1, 1, 8.0)
    last = cfg.last_owning_layer

    def one_row(name: str) -> bool:  # a linear of a KV-shared layer, or the last owning one's
        if "layers." not in name:
            return False
        layer = int(name.split("layers.")[1].split(".")[0])
        return layer > last or (layer == last and not name.endswith(("k_proj", "v_proj")))

    few = sum(m.weight.numel() for name, m in target.model.named_modules()
              if isinstance(m, torch.nn.Linear) and one_row(name))  # fmt: skip
    head = cfg.vocab_size * cfg.hidden_size
    assert work.few_rows_bytes == few + head
    assert work.few_rows_flops == 2 * (few + head)  # one row through each
    assert forward_work(cfg, range(8), 8, 8, 8.0).few_rows_bytes == 0  # a verify: all rows
    # the pruned layers' activation elements: one row's, the last owning layer's K/V all rows'
    assert work.linear_elements < forward_work(cfg, range(8), 8, 8, 8.0).linear_elements
    # priced apart: the body compute-bound, the few-row part memory-bound, one after the other
    unit = _unit()  # 10 GB/s, 1 int8 TOPS
    call = Work(flops=4e10 + 1e6, weight_bytes=2e8, rows=8, few_rows_bytes=1e8, few_rows_flops=1e6)
    assert call_seconds(call, unit, "int8", 0) == pytest.approx(0.040 + 0.010)


def _unit(**changes) -> DelegateProfile:
    base = DelegateProfile(
        name="cpu",
        unit="test",
        dispatch_unit="kernel",
        memory_bandwidth_gbs=10.0,
        peak_memory_bandwidth_gbs=20.0,
        peak_tops={"int8": 1.0, "fp32": 0.25},
        dispatch_us=2.0,
        active_w=3.0,
        idle_w=1.0,
    )
    return replace(base, **changes)


def test_call_seconds_is_roofline_plus_dispatch():
    unit = _unit()
    memory_bound = Work(flops=1e9, weight_bytes=1e8)  # 10 ms reading, 1 ms computing
    assert call_seconds(memory_bound, unit, "int8", 100) == pytest.approx(0.010 + 100 * 2e-6)
    compute_bound = Work(flops=4e10, weight_bytes=1e8)  # 40 ms of int8 compute
    assert call_seconds(compute_bound, unit, "int8", 0) == pytest.approx(0.040)
    assert call_seconds(compute_bound, unit, "fp32", 0) == pytest.approx(0.160)
    graph = _unit(dispatch_unit="graph", dispatch_us=300.0)  # one dispatch per call
    assert call_seconds(memory_bound, graph, "int8", 5000) == pytest.approx(0.010 + 300e-6)


def test_linears_pay_for_their_activation_elements_as_calibration_solves_it():
    """A GEMM is priced as its FLOPs at the peak plus its activation elements (rows x (inputs
    + outputs)) at `ns_per_linear_element`; calibration solves both from a wide and a narrow
    linear's times, and finds no element cost where the narrow one is as fast per FLOP."""
    unit = _unit(ns_per_linear_element=0.5)  # 1 int8 TOPS
    work = Work(flops=4e10, weight_bytes=1e6, rows=256, linear_elements=2e7)
    assert call_seconds(work, unit, "int8", 0) == pytest.approx(0.040 + 0.010)
    assert call_seconds(work, _unit(), "int8", 0) == pytest.approx(0.040)
    # one row, memory-bound: its elements at the matrix-vector rate, beside its 10 ms of weights
    gemv = _unit(ns_per_linear_element=0.5, ns_per_gemv_element=4.0)
    step = Work(flops=1e8, weight_bytes=1e8, rows=1, linear_elements=1e6)
    assert call_seconds(step, gemv, "int8", 0) == pytest.approx(0.010 + 0.004)
    verify = replace(step, rows=4, linear_elements=4e6)  # once per call, not per row
    assert call_seconds(verify, gemv, "int8", 0) == pytest.approx(0.010 + 0.004)
    assert call_seconds(work, gemv, "int8", 0) == pytest.approx(0.050)  # a chunk: the GEMM's
    shapes = [(256, 1024), (256, 256)]
    seconds = [2 * r * n * n / 0.4e12 + r * 2 * n * 0.2e-9 for r, n in shapes]  # 0.4 TOPS, 0.2 ns
    tops, ns = fit_gemm(shapes, seconds)
    assert (tops, ns) == (pytest.approx(0.4), pytest.approx(0.2))
    wide_rate = [2 * r * n * n / 0.4e12 for r, n in shapes]
    assert fit_gemm(shapes, wide_rate) == (pytest.approx(0.4), 0.0)
    assert fit_gemm(shapes, [wide_rate[0], wide_rate[1] * 0.9]) == (pytest.approx(0.4), 0.0)


def test_nodes_that_are_not_matmuls_and_weights_that_stay_in_the_cache():
    unit = _unit()  # 10 GB/s, 2 us per launch
    memory_bound = Work(flops=1e9, weight_bytes=1e8, rows=1)  # 10 ms reading
    # 100 launches, 70 of them elementwise nodes at 0.2 us: 30 x 2 + 70 x 0.2 = 74 us
    light = replace(unit, node_us=0.2)
    terms = call_terms(memory_bound, light, "int8", 100, nodes=70)
    assert terms.dispatch_s == pytest.approx(74e-6)
    assert call_terms(memory_bound, unit, "int8", 100, nodes=70).dispatch_s == pytest.approx(200e-6)
    # 4 MiB, no more than the resident rates' probe (calibrate's, 4.5 MiB): they stream at
    # those rates, 40 GB/s on one row, 20 on four
    cached = replace(unit, verify_bandwidth_gbs=5.0, resident_mb=128.0, resident_bandwidth_gbs=40.0,
                     resident_verify_bandwidth_gbs=20.0)  # fmt: skip
    small, few_rows = Work(weight_bytes=4 * 2**20, rows=1), Work(weight_bytes=4 * 2**20, rows=4)
    assert call_terms(small, cached, "int8", 0).memory_s == pytest.approx(4 * 2**20 / 40e9)
    assert call_terms(few_rows, cached, "int8", 0).memory_s == pytest.approx(4 * 2**20 / 20e9)
    assert RESIDENT_LINEARS * 1024**2 * (0.5 + 2 / 32) / 2**20 == RESIDENT_PROBE_MB
    assert resident_size(130.0) == 1024
    # 100 MB (95.4 MiB) of a 128 MiB budget: the time per byte 91 % of the way, in log size,
    # from the resident rate to the memory rate
    far = math.log(1e8 / 2**20 / 4.5) / math.log(128 / 4.5)
    assert far == pytest.approx(0.912, abs=1e-3)
    seconds = call_terms(memory_bound, cached, "int8", 0).memory_s
    assert seconds == pytest.approx(1e8 * ((1 - far) / 40e9 + far / 10e9))
    four_rows = Work(flops=4e9, weight_bytes=1e8, rows=4)
    seconds = call_terms(four_rows, cached, "int8", 0).memory_s
    assert seconds == pytest.approx(1e8 * ((1 - far) / 20e9 + far / 5e9))
    # one byte more than the budget: streamed from memory (10 GB/s; 5 GB/s on four rows)
    over = Work(flops=1e9, weight_bytes=128 * 2**20 + 1, rows=1)
    assert call_terms(over, cached, "int8", 0).memory_s == pytest.approx(over.weight_bytes / 10e9)
    assert call_terms(
        replace(four_rows, weight_bytes=over.weight_bytes), cached, "int8", 0
    ).memory_s == pytest.approx(over.weight_bytes / 5e9)


def test_portable_kernels_loop_in_bookkeeping_or_move_bytes():
    per_op = {
        "aten.where.self": 10,
        "aten.lt.Tensor": 20,
        "aten.bitwise_and.Tensor": 3,
        "aten.select_copy.int": 100,
        "dim_order_ops._to_dim_order_copy.default": 1000,
        "scalar_tensor.default": 1,
    }
    manifest = {"backend_details": {"delegation": {
        "draft_step": {"portable_elements": 1134, "portable_elements_by_op": per_op},
        "verify_0": {"portable_elements": 77},  # a bundle from before the split
    }}}  # fmt: skip
    assert portable_elements(manifest) == ({"draft_step": 33, "verify_0": 77}, {"draft_step": 1101})
    unit = _unit(ns_per_portable_element=7.0)  # 10 GB/s
    terms = call_terms(Work(rows=1), unit, "int8", 0, portable=33, moved=1101)
    assert terms.elements_s == pytest.approx(33 * 7e-9 + 1101 * 8 / 10e9)


def test_attention_is_priced_after_the_linears_with_its_own_rates():
    # linears: max(1e8 B / 10 GB/s, 1e9 FLOP / 1 TOPS) = 10 ms; attention: max(2e7 B / 5 GB/s,
    # 2e8 FLOP / 0.1 TFLOPS) = 4 ms; 1e6 scores x 2 ns = 2 ms; 10 launches x 2 us
    work = Work(flops=1.2e9, weight_bytes=1e8, cache_bytes=2e7, attention_flops=2e8, scores=1e6)
    unit = _unit(attention_tops=0.1, attention_bandwidth_gbs=5.0, ns_per_score=2.0)
    assert call_seconds(work, unit, "int8", 10) == pytest.approx(0.010 + 0.004 + 0.002 + 20e-6)
    # and 1e5 elements written by portable kernels at 30 ns each: 3 ms more
    fallback = replace(unit, ns_per_portable_element=30.0)
    assert call_terms(work, fallback, "int8", 10, portable=100_000).seconds == pytest.approx(
        0.010 + 0.004 + 0.002 + 0.003 + 20e-6
    )
    # and 2e6 elements written by other non-matmul kernels at 0.5 ns each: 1 ms more
    elementwise = replace(fallback, ns_per_element=0.5)
    terms = call_terms(work, elementwise, "int8", 10, portable=100_000, elementwise=2_000_000)
    assert terms.seconds == pytest.approx(0.010 + 0.004 + 0.002 + 0.003 + 0.001 + 20e-6)
    # and 30 linear kernels at 5 us each beyond their bytes and launch: 150 us more
    linear = replace(elementwise, linear_us=5.0)
    terms = call_terms(work, linear, "int8", 10, 100_000, 2_000_000, linears=30)
    assert terms.seconds == pytest.approx(0.010 + 0.004 + 0.002 + 0.003 + 0.001 + 170e-6)
    assert terms.dispatch_s == pytest.approx(170e-6)
    # without them: K/V at the memory bandwidth (2 ms), attention FLOPs at fp32's 0.25 TFLOPS
    # (0.8 ms), scores free
    assert call_seconds(work, _unit(), "int8", 10) == pytest.approx(0.010 + 0.002 + 20e-6)


def test_float_linears_of_a_bundle_are_priced_at_the_activation_peak():
    # int4 linears: 2e9 FLOP at 1 int8 TOPS = 2 ms (weights: 1 MB at 10 GB/s, 0.1 ms); the
    # program's fp32 linears (offset pairs, norm means): 5e8 FLOP at 0.25 fp32 TFLOPS = 2 ms
    work = Work(flops=2e9, weight_bytes=1e6)
    assert call_terms(work, _unit(), "int8", 0).compute_s == pytest.approx(0.002)
    terms = call_terms(work, _unit(), "int8", 0, float_flops=5e8)
    assert terms.compute_s == pytest.approx(0.004)
    assert terms.seconds == pytest.approx(0.004)
    manifest = {"backend_details": {"delegation": {"verify_0": {"float_linear_flops": 123}}}}
    assert float_linear_flops(manifest) == {"verify_0": 123}


def test_calibration_solves_the_attention_model_for_its_rates():
    tops, ns, bandwidth = 0.2, 1.5, 6.0  # what the times below are made of
    seconds = []
    for heads, rows, keys, dim in ATTENTION_SHAPES:
        scores = heads * rows * (keys + rows)
        kv = 2 * (keys + rows) * dim * 4
        seconds.append(max(kv / (bandwidth * 1e9), 4 * scores * dim / (tops * 1e12))
                       + scores * ns * 1e-9)  # fmt: skip
    assert fit_attention(ATTENTION_SHAPES, seconds) == pytest.approx((tops, ns, bandwidth))


def test_a_few_rows_stream_weights_at_the_verify_bandwidth():
    unit = _unit(verify_bandwidth_gbs=2.5, call_us=30.0)  # 10 GB/s for one row (_unit)
    one, four, chunk = (Work(flops=0.0, weight_bytes=1e8, rows=r) for r in (1, 4, 64))
    assert call_seconds(one, unit, "int8", 0) == pytest.approx(
        1e8 / unit.memory_bandwidth_gbs / 1e9 + 30e-6
    )
    assert call_seconds(four, unit, "int8", 0) == pytest.approx(1e8 / 2.5e9 + 30e-6)
    assert call_seconds(chunk, unit, "int8", 0) == call_seconds(one, unit, "int8", 0)
    # between one row and the probe's four, the time per byte grows by one step a row
    # (0.1 ns/B for one row, 0.4 for four: 0.2 for two, 0.3 for three); 5-16 rows at four's
    for rows, ns_per_byte in ((2, 0.2), (3, 0.3), (8, 0.4), (16, 0.4)):
        work = Work(flops=0.0, weight_bytes=1e8, rows=rows)
        seconds = 1e8 * ns_per_byte * 1e-9 + 30e-6
        assert call_seconds(work, unit, "int8", 0) == pytest.approx(seconds)


def test_the_hosts_cost_is_added_per_call_per_row_and_per_logit_row():
    model = replace(model_from_preset("e2b", "q4_0", 4096, 128, max_draft=3), verify_depths=())
    profile = load_profile("galaxy-s26-ultra")
    acceptance = mean_acceptance(0.7, 0.9, 3)
    bare, hosted = (
        simulate(model, replace(profile, delegates={"cpu": unit}), "cpu", (0, 2), acceptance,
                 256, 128)
        for unit in (_unit(), _unit(host_call_us=500.0, host_ns_per_logit=2.0,
                                    host_us_per_row=3.0))
    )  # fmt: skip
    call, row, gather = 500e-6, 2e-9 * model.target.vocab_size, 3e-6
    # depth k: k drafter calls and one verify, each with its host call; k + (k + 1) logit rows;
    # the verify gathers k + 1 rows, k beyond its first
    for k in (0, 2):
        extra = (k + 1) * call + (2 * k + 1) * row + k * gather
        assert hosted.round_ms[k] - bare.round_ms[k] == pytest.approx(1000 * extra)
    chunks = 2  # 256 prompt tokens in chunks of 128; one token chosen at the end
    host = chunks * call + row + chunks * 127 * gather
    assert hosted.ttft_s - bare.ttft_s == pytest.approx(host)
    # the terms add up to what was predicted
    t = hosted.terms
    assert t["prefill"].seconds == pytest.approx(hosted.ttft_s)
    assert t["prefill"].host_s == pytest.approx(host)
    round_2 = t["verify_2"].seconds + 2 * t["draft_step"].seconds
    assert 1000 * round_2 == pytest.approx(hosted.round_ms[2])


def test_the_host_costs_less_where_a_small_models_calls_leave_the_cache_warm():
    """A call whose weights and K/V stay in the cache leaves the host's own data there too:
    its host time is `resident_host_call_us`; past `resident_mb`, `host_call_us`; between the
    probe's size and the limit, in log size as the streaming rate falls."""
    unit = _unit(host_call_us=200.0, resident_host_call_us=100.0, resident_mb=16.0)
    at = {mb: host_call_us(unit, Work(flops=0.0, weight_bytes=mb * 2**20)) for mb in (1, 4.5, 32)}
    assert at == {1: 100.0, 4.5: 100.0, 32: 200.0}
    middle = math.sqrt(4.5 * 16)  # halfway in log size
    assert host_call_us(unit, Work(flops=0.0, weight_bytes=middle * 2**20)) == pytest.approx(150.0)
    assert host_call_us(replace(unit, resident_host_call_us=None), Work(flops=0.0)) == 200.0


def test_a_prompt_is_priced_through_the_context_bucket_its_chunks_fit():
    """As the runtime runs it: a chunk ending within a context bucket reads that bucket's
    slots, others the whole cache; a bundle exported before prefill had buckets reads the
    whole cache for every chunk."""
    model = model_from_preset("e2b", "q4_0", 4096, 128, buckets=(512, 2048))
    whole = model.cache_keys()
    assert model.prefill(True, 100) == ("prefill_final_ctx512", model.cache_keys(100))
    assert model.cache_keys(100)["full"] == 512 < whole["full"]
    assert model.prefill(False, 640) == ("prefill_intermediate_ctx2048", model.cache_keys(2048))
    assert model.prefill(True, 3000) == ("prefill_final", whole)
    older = replace(model, prefill_buckets=False)
    assert older.prefill(True, 100) == ("prefill_final", whole)
    profile = load_profile("galaxy-s26-ultra")
    acceptance = mean_acceptance(0.7, 0.9, 3)
    ttft = {m.prefill_buckets: simulate(m, profile, "cpu", (0,), acceptance, 256, 16).ttft_s
            for m in (model, older)}  # fmt: skip
    assert ttft[True] < ttft[False]


def test_acceptance_from_a_trace_counted_by_hand(tmp_path):
    # rounds (drafted, accepted): draft 1 tried 4 times, accepted 3; draft 2 tried 3, accepted 1
    rounds = [(2, 2), (2, 1), (2, 0), (1, 1), (0, 0)]
    trace = [{"kind": "prefill", "drafted": 0, "accepted": 0}]
    trace += [{"kind": "decode", "drafted": k, "accepted": n} for k, n in rounds]
    (tmp_path / "run.json").write_text(json.dumps({"trace": trace}))
    acc = trace_acceptance(tmp_path / "run.json")
    assert acc.per_position == pytest.approx((3 / 4, 1 / 2))
    assert acc.expected_tokens(2) == pytest.approx(1 + 3 / 4 + 3 / 8)
    assert mean_acceptance(0.8, 0.5, 3).per_position == pytest.approx((0.8, 0.4, 0.2))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(EdgeMTPError, match="not an `edgemtp generate --json` output"):
        trace_acceptance(tmp_path / "bad.json")


def _adaptive_choice(prediction, acceptance, rounds: int = 300) -> int:
    """Feed the runtime's adaptive policy the simulated round costs and an acceptance process
    with the simulated rates (deterministic: draft i accepted in a_i of the rounds); the depth it
    settles on."""
    depths = sorted(prediction.round_ms)
    policy = AdaptiveDepth(max(depths), lambda k: f"verify_{k}")
    draft_ms = prediction.draft_ms
    credit = [0.0] * (max(depths) + 1)
    chosen = []
    for _ in range(rounds):
        k = policy.choose(max(depths))
        accepted = 0
        for i in range(1, k + 1):
            credit[i] += acceptance.rate(i)
            if credit[i] < 1:
                break
            credit[i] -= 1
            accepted = i
        step = Step("decode", 0, k + 1, drafted=k, accepted=accepted, committed=accepted + 1)
        step.seconds = {"drafter": k * draft_ms / 1000, "total": prediction.round_ms[k] / 1000}
        policy.observe(step)
        chosen.append(k)
    tail = chosen[rounds // 2 :]
    return max(set(tail), key=tail.count)


def test_mtp_loses_where_verifying_more_rows_is_dear_and_the_runtime_agrees(pair):
    """A device whose verify cost grows steeply with rows (compute-bound, as reported for a
    PowerVR GPU) makes MTP slower than AR even at 70 % acceptance; on a bandwidth-bound one the
    same model and acceptance gain. The adaptive runtime, fed the simulated costs, picks the
    same depth as the simulator's best."""
    model = replace(model_from_preset("e2b", "q4_0", 4096, 128, max_draft=3), verify_depths=())
    profile = load_profile("galaxy-s26-ultra")
    acceptance = mean_acceptance(0.7, 0.9, 3)
    steep = _unit(dispatch_unit="graph", memory_bandwidth_gbs=60.0, peak_tops={"fp16": 0.05})
    flat = _unit(dispatch_unit="graph", memory_bandwidth_gbs=60.0, peak_tops={"fp16": 50.0})
    results = {}
    for name, unit in (("steep", steep), ("flat", flat)):
        device = replace(profile, delegates={"gpu": replace(unit, name="gpu")})
        results[name] = simulate(model, device, "gpu", (0, 1, 2, 3), acceptance, 256, 128)
    steep_r, flat_r = results["steep"], results["flat"]
    assert steep_r.round_ms[3] > 3 * steep_r.round_ms[0]  # cost grows with the rows
    assert steep_r.best_depth == 0 and steep_r.decode_tok_s[3] < steep_r.decode_tok_s[0]
    assert flat_r.best_depth == 3 and flat_r.decode_tok_s[3] > 1.5 * flat_r.decode_tok_s[0]
    assert _adaptive_choice(steep_r, acceptance) == 0
    assert _adaptive_choice(flat_r, acceptance) == 3


def test_simulate_on_the_command_line(capsys):
    code = main(
        ["simulate", "--preset", "e2b", "--device", "pixel-10-pro", "--delegate", "cpu",
         "--mtp", "0,2", "--acceptance", "0.7:0.9", "--json"]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(out) >= {
        "prefill_tok_s", "ttft_s", "decode_tok_s", "best_depth", "energy_j_per_token",
        "battery_pct_per_1k_tokens", "peak_memory_mb", "assumptions",
    }  # fmt: skip
    assert set(out["decode_tok_s"]) == {"0", "2"} and out["best_depth"] in (0, 2)
    assert out["ttft_s"] == pytest.approx(512 / out["prefill_tok_s"])
    rate = out["decode_tok_s"][str(out["best_depth"])]
    device = load_profile("pixel-10-pro")
    watts = device.delegates["cpu"].idle_w + device.delegates["cpu"].active_w
    assert out["energy_j_per_token"] == pytest.approx(watts / rate)
    assert out["battery_pct_per_1k_tokens"] == pytest.approx(
        1000 * out["energy_j_per_token"] / (device.battery_wh * 3600) * 100
    )
    assert main(["simulate", "--preset", "e2b", "--device", "raspberry-pi-5", "--delegate",
                 "npu"]) == 1  # fmt: skip
    assert "has no 'npu' delegate" in capsys.readouterr().err


def test_calibrate_writes_a_profile_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "host.toml"
    assert main(["devices", "calibrate", "--threads", "1", "--quick", "--out", str(out)]) == 0
    capsys.readouterr()
    host = load_profile(out)
    cpu = host.delegates["cpu"]
    assert cpu.threads == 1 and host.battery_wh is None
    assert 0 < cpu.memory_bandwidth_gbs <= cpu.peak_memory_bandwidth_gbs
    assert set(cpu.peak_tops) == {"int8", "fp16", "fp32"} and cpu.dispatch_us > 0
    assert cpu.host_call_us > 0 and cpu.host_ns_per_logit > 0 and cpu.verify_bandwidth_gbs > 0
    onnx = cpu.for_backend("onnx")  # ONNX Runtime's kernels, measured apart
    attention = {"attention_tops", "ns_per_score", "attention_bandwidth_gbs"}
    # weights that stay in the cache, where sysfs tells its size
    resident = {"resident_bandwidth_gbs", "resident_verify_bandwidth_gbs"}
    # the element costs are written only where measured above zero (a quick run's tiny
    # linears may show none)
    elements = {"ns_per_linear_element", "ns_per_gemv_element"}
    assert set(cpu.backends["onnx"]) - elements == {
        "memory_bandwidth_gbs", "verify_bandwidth_gbs", "dispatch_us", "call_us", "peak_tops",
        "ns_per_element", "linear_us", *attention, *(resident if cpu.resident_mb else ()),
    }  # fmt: skip
    assert all(onnx.__dict__[name] is None or onnx.__dict__[name] > 0 for name in elements)
    if cpu.resident_mb:
        assert all(getattr(unit, name) > 0 for name in resident for unit in (cpu, onnx))
        assert cpu.resident_host_call_us > 0  # the host beside a program that stays cached
    assert cpu.node_us > 0
    for unit in (cpu, onnx):
        assert all(getattr(unit, name) > 0 for name in attention)
    assert cpu.ns_per_portable_element > 0 and onnx.ns_per_element > 0
    assert onnx.peak_tops.keys() == {"int8"} and onnx.memory_bandwidth_gbs > 0
    # edgemtp's Q4_0 kernel, where its library loads (the steps of a --kernels edgemtp bundle)
    kernels = cpu.for_backend("executorch", "kernels")
    assert set(cpu.backends["kernels"]) == {
        "memory_bandwidth_gbs", "verify_bandwidth_gbs", "ns_per_gemv_element",
        *(resident if cpu.resident_mb else ()),
    }  # fmt: skip
    assert kernels.verify_bandwidth_gbs > 0 and kernels.dispatch_us == cpu.dispatch_us
    assert kernels.memory_bandwidth_gbs not in (cpu.memory_bandwidth_gbs, onnx.memory_bandwidth_gbs)
    measured = [k for k, (src, _) in host.sources.items() if src.startswith("measured")]
    assert {"delegates.cpu.memory_bandwidth_gbs", "delegates.cpu.dispatch_us",
            "delegates.cpu.host_call_us"} <= set(measured)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.toml"]  # no partial file left
    argv = ["simulate", "--preset", "e2b", "--device", str(out), "--delegate", "cpu", "--mtp",
            "0", "--json"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["best_depth"] == 0


def test_devices_list_names_every_shipped_profile(capsys):
    assert main(["devices", "list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    for name in ("galaxy-s26-ultra", "pixel-10-pro", "iphone-17-pro", "raspberry-pi-5"):
        assert name in listed


def test_steps_through_the_q4_0_kernel_read_its_blocks_and_prompt_chunks_read_8da4w():
    """A kernel bundle's decode, verify and draft steps read the checkpoint's Q4_0 blocks (4.5
    bits per weight); its prompt chunks read the 8da4w form with offsets the program stores."""
    assert kernel_step_bits({"backend_details": {"q4_0_kernel_linears": 85}}) == 4.5
    assert kernel_step_bits({"backend_details": {"q4_0_kernel_linears": 0}}) is None
    assert kernel_step_bits({"backend_details": {}}) is None
    stored = replace(model_from_preset("e2b", "q4_0", 1024, 128, max_draft=3), stored_bits=5.5)
    kernel = replace(stored, step_bits_read=4.5)
    assert (stored.step_bits, kernel.step_bits) == (5.5, 4.5)
    plain = replace(stored, stored_bits=4.5)  # every call at 4.5 bits
    profile, acceptance = load_profile("galaxy-s26-ultra"), mean_acceptance(0.7, 0.9, 3)
    runs = {
        name: simulate(m, profile, "cpu", (0, 2), acceptance, 256, 16)
        for name, m in (("stored", stored), ("kernel", kernel), ("plain", plain))
    }
    assert runs["kernel"].ttft_s == pytest.approx(runs["stored"].ttft_s)
    assert runs["kernel"].ttft_s > runs["plain"].ttft_s
    for term in ("verify_0", "verify_2", "draft_step"):
        assert runs["kernel"].terms[term].seconds == pytest.approx(
            runs["plain"].terms[term].seconds
        )
        assert runs["kernel"].terms[term].seconds < runs["stored"].terms[term].seconds
    # where a profile measured the kernel apart (`devices calibrate`), the steps stream their
    # weights at its rates and prompt chunks at the executorch ones
    cpu = profile.delegates["cpu"]
    rates = {"memory_bandwidth_gbs": cpu.memory_bandwidth_gbs / 2, "verify_bandwidth_gbs": 3.0}
    cpu = replace(cpu, backends={"kernels": rates})
    measured = replace(profile, delegates={**profile.delegates, "cpu": cpu})
    slow = simulate(kernel, measured, "cpu", (0, 2), acceptance, 256, 16)
    assert slow.ttft_s == pytest.approx(runs["kernel"].ttft_s)
    for term in ("verify_0", "verify_2", "draft_step"):
        weights = runs["kernel"].terms[term].memory_s
        assert slow.terms[term].memory_s > 1.5 * weights
    assert "kernels section" in slow.assumptions["step_kernels"]
    # the kernel computes a few rows at the FLOP rate its 4-row probe streamed at (2 FLOPs per
    # weight and row: 4.5 GB/s of 4.5-bit weights on 4 rows is 64 GFLOPS), each row's
    # elements at its one-row element cost, not XNNPACK's GEMM peak and element cost
    own = q4_0_kernel(cpu, "int8", {"verify_bandwidth_gbs": 4.5, "ns_per_gemv_element": 2.0})
    assert own.peak_tops == {**cpu.peak_tops, "int8": pytest.approx(0.064)}
    assert own.ns_per_linear_element == 2.0
    assert q4_0_kernel(cpu, "int8", {"memory_bandwidth_gbs": 9.0}) is cpu
    assert simulate(stored, measured, "cpu", (0,), acceptance, 256, 16).terms[
        "verify_0"
    ].seconds == pytest.approx(runs["stored"].terms["verify_0"].seconds)  # no kernel: unchanged


def test_an_int8_cache_is_priced_by_its_rows_bytes(capsys):
    """K/V bytes a step reads: int8 codes and each row's 4-byte scale (as the cache stores
    them), against float16's 2 bytes an element; a long-context decode reads less and runs
    faster, the peak holds less."""
    cfg = parse_text_config(preset_config("e2b"))
    spec = cfg.layers[cfg.first_shared_layer]
    source = cfg.layers[spec.kv_source]
    positions = range(4000, 4001)
    fp16, int8 = (kv_read_bytes(cfg, spec, positions, None, n) for n in (2, 1))
    assert int8 / fp16 == (source.head_dim + 4) / (2 * source.head_dim)
    out = {}
    for kv in ("fp16", "int8"):
        # (the GPU: a memory-bound attention; on the CPU its arithmetic binds at this length)
        argv = ["simulate", "--preset", "e2b", "--device", "galaxy-s26-ultra", "--delegate", "gpu"]
        argv += ["--max-context", "8192", "--prompt", "8000", "--gen", "64", "--mtp", "0"]
        assert main([*argv, "--kv-cache", kv, "--json"]) == 0
        out[kv] = json.loads(capsys.readouterr().out)
    assert out["int8"]["decode_tok_s"]["0"] > out["fp16"]["decode_tok_s"]["0"]
    assert out["int8"]["peak_memory_mb"] < out["fp16"]["peak_memory_mb"]
