"""The host-side simulator: speed, energy and memory of a bundle (or a preset) on a device
profile, from first principles.

Each program call is priced from its own bytes, FLOPs and attention scores (`model.cost`) and
its launches (counted from the bundle's program on a "kernel" delegate; one on a "graph" one):

    seconds = max(weight bytes / sustained bandwidth, linear FLOPs / peak of the compute dtype)
              + max(K/V bytes / attention bandwidth, attention FLOPs / peak of the activations)
              + scores x time per score + elements non-matmul kernels write x time per element
              + launches x dispatch cost + host cost per call and per logit chosen from

Prefill runs chunk by chunk, pruned as the exported methods are (or not, for other engines'
published figures). A shipped phone profile holds hardware specifications; what a runtime really
achieves on it (bandwidth, throughput, launch costs, an engine's factor) is fitted to published
figures by `devices/fit.py` and passed in as `Rates`. A decode round at depth k costs
k drafter steps plus a verify of k + 1 rows and commits E_k = 1 + sum_{j<=k} prod_{i<=j} a_i
tokens on average (a_i: per-position acceptance, measured or a mean with a decay); decode speed
is E_k / round time at the middle of the generated span. Energy is (idle + active power) x time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgemtp.devices.profiles import DelegateProfile, DeviceProfile
from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import cache_bytes, cache_slots
from edgemtp.model.config import AssistantConfig, TextConfig
from edgemtp.model.cost import (
    BITS_PER_WEIGHT,
    Work,
    draft_work,
    forward_work,
    layer_weights,
    static_cache_keys,
)
from edgemtp.model.forward import prefill_chunks
from edgemtp.model.static import StaticShapes
from edgemtp.runtime.adaptive import expected_committed
from edgemtp.runtime.bench import acceptance_by_position
from edgemtp.runtime.kernels.ops import KERNEL_MAX_ROWS

# Operators per decoder layer an exported XNNPACK program dispatches, when no bundle says (the
# PEER-90M ExecuTorch export: verify_0 runs 1791 operators over 12 layers, portable kernel calls
# plus XNNPACK graph nodes).
OPS_PER_LAYER = 150
# Compute dtype of each delegate's int4 linears: XNNPACK's 8da4w quantizes activations to int8;
# GPUs and the ANE compute fp16; the HTP int8. W4A16 on a CPU computes in fp32.
COMPUTE_DTYPE = {"cpu": "int8", "gpu": "fp16", "metal": "fp16", "npu": "fp16", "htp": "int8"}
# Attention (activations x activations) runs in fp32 in XNNPACK CPU programs, fp16 elsewhere.
ACTIVATION_DTYPE = {"cpu": "fp32", "gpu": "fp16", "metal": "fp16", "npu": "fp16", "htp": "fp16"}
VERIFY_ROWS = 16  # calls of 2..16 rows are a verify's few rows (`rows_rate`)
VERIFY_PROBE_ROWS = 4  # the rows `devices calibrate` measures verify_bandwidth_gbs on
RUNTIME_OVERHEAD_MB = 150.0  # the runtime itself (ExecuTorch, Python host), an estimate


@dataclass(frozen=True)
class Model:
    """What the simulator needs to know about a bundle or a preset."""

    target: TextConfig
    drafter: AssistantConfig | None
    quant: str
    chunk: int
    max_context: int
    program_bytes: float  # weights as stored on the device (program + tables)
    launches: dict[str, int] = field(default_factory=dict)  # method -> operators, from a bundle
    source: str = ""
    verify_depths: tuple[int, ...] = ()  # a bundle's verify methods (shallower rounds are padded)
    max_draft: int = 0
    buckets: tuple[int, ...] = ()  # context buckets (`StaticShapes.context_buckets`)
    full_drafter_head: bool = False  # an int4 clustered head computes every vocabulary row
    stored_bits: float | None = None  # bits per linear weight as the program stores them
    backend: str | None = None  # a bundle's: selects the profile's numbers for that backend
    portable: dict[str, int] = field(default_factory=dict)  # method -> portable elements per call
    elementwise: dict[str, int] = field(default_factory=dict)  # method -> non-matmul elements
    linears: dict[str, int] = field(default_factory=dict)  # method -> linear kernels, where counted
    nodes: dict[str, int] = field(default_factory=dict)  # method -> launches that are not matmuls
    prefill_buckets: bool = True  # prefill methods per context bucket too (older bundles: no)
    moved: dict[str, int] = field(default_factory=dict)  # method -> portable elements copied
    float_flops: dict[str, int] = field(default_factory=dict)  # method -> FLOPs of fp32 linears
    # decode, verify and draft attention reads only the keys attended (edgemtp's kernel,
    # `edgemtp::cache_attention_rows`), not every slot of the method's cache
    attended_keys_only: bool = False
    cache_itemsize: int = 4  # bytes per K/V element the program stores (float16: 2, int8: 1)
    # bits per linear weight the decode, verify and draft steps read where they run another form
    # than prefill: edgemtp's Q4_0 kernel reads the checkpoint's blocks (`kernel_step_bits`)
    step_bits_read: float | None = None
    # published figures of other engines: a prefill that runs every layer on every row, and a
    # cache that grows with the prompt (each call reads the keys before it, once)
    pruned_prefill: bool = True
    dynamic_cache: bool = False

    @property
    def shapes(self) -> StaticShapes:
        return StaticShapes(self.max_context, self.max_draft, self.chunk, self.buckets)

    def cache_keys(self, end: int | None = None, rows: int = 1) -> dict[str, int]:
        """Cache keys per attention kind a method of `rows` rows reads for rows ending before
        `end` (None: a method that reads the whole cache)."""
        slots = cache_slots(self.target, self.max_context, self.max_draft)
        if self.attended_keys_only and end is not None and rows <= KERNEL_MAX_ROWS:
            window = self.target.sliding_window
            return {k: min(end, window if k == "sliding" else n) for k, n in slots.items()}
        return static_cache_keys(slots, None if end is None else self.shapes.bucket(end))

    def dynamic_keys(self, start: int) -> dict[str, int]:
        """Keys before row `start` per attention kind, in a cache that holds only those."""
        window = self.target.sliding_window
        return {"sliding": min(start, window), "full": start}

    def prefill(self, final: bool, end: int) -> tuple[str, dict[str, int]]:
        """The prefill method a chunk of rows ending before `end` runs, and the cache keys it
        reads per attention kind."""
        if self.prefill_buckets:
            return self.shapes.prefill_method(final, end), self.cache_keys(end)
        return ("prefill_final" if final else "prefill_intermediate"), self.cache_keys()

    def verify(self, depth: int) -> tuple[str, int]:
        """The verify method a round of `depth` drafts runs, and the rows it computes."""
        d = min((v for v in self.verify_depths if v >= depth), default=depth)
        return f"verify_{d}", d + 1

    @property
    def step_kernels(self) -> str | None:
        """The profile section the decode, verify and draft steps' linears take their rates
        from, where they run edgemtp's Q4_0 kernel ("kernels"; None: the bundle's backend's)."""
        return "kernels" if self.step_bits_read is not None else None

    @property
    def bits(self) -> float:
        return self.stored_bits or BITS_PER_WEIGHT[self.quant]

    @property
    def step_bits(self) -> float:
        """Bits per linear weight of a decode, verify or draft step."""
        return self.step_bits_read or self.bits


@dataclass(frozen=True)
class Acceptance:
    """a_i: probability that draft i is accepted given drafts 1..i-1 were."""

    per_position: tuple[float, ...]
    source: str

    def rate(self, i: int) -> float:
        if not self.per_position:
            return 0.0
        return self.per_position[min(i, len(self.per_position)) - 1]

    def expected_tokens(self, depth: int) -> float:
        return expected_committed(self.rate(i) for i in range(1, depth + 1))


def mean_acceptance(mean: float, decay: float, depth: int) -> Acceptance:
    if not (0 <= mean <= 1 and 0 < decay <= 1):
        raise EdgeMTPError(
            f"--acceptance {mean}:{decay}: give a rate in [0, 1] and a decay in (0, 1]"
        )
    rates = tuple(mean * decay ** (i - 1) for i in range(1, max(depth, 1) + 1))
    return Acceptance(rates, f"mean {mean} for draft 1, x{decay} per later position")


def trace_acceptance(path: Path) -> Acceptance:
    """Per-position acceptance from `edgemtp generate --json` output (its `trace` of rounds)."""
    try:
        payload = json.loads(Path(path).read_text())
        steps = [s for s in payload["trace"] if s["kind"] == "decode"]
        pairs = [(int(s["drafted"]), int(s["accepted"])) for s in steps]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EdgeMTPError(
            f"{path}: not an `edgemtp generate --json` output with a trace ({err}); pass a mean "
            "acceptance instead, e.g. --acceptance 0.7"
        ) from None
    if not any(k for k, _ in pairs):
        raise EdgeMTPError(f"{path}: no round in this trace drafted; run generate with --mtp 1+")
    return acceptance_from_rounds(pairs, f"measured: {len(pairs)} rounds of {path}")


def acceptance_from_rounds(rounds: Sequence[Sequence[int]], source: str) -> Acceptance:
    """Per-position acceptance of measured rounds (drafted, accepted); a position no round
    reached takes the rate before it."""
    rates: list[float] = []
    for rate in acceptance_by_position(rounds):
        rates.append(rate if rate is not None else (rates[-1] if rates else 0.0))
    return Acceptance(tuple(rates), source)


@dataclass
class Prediction:
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: dict[int, float]
    best_depth: int
    energy_j_per_token: float
    battery_pct_per_1k_tokens: float | None
    peak_memory_mb: float
    round_ms: dict[int, float]
    draft_ms: float  # one drafter step
    expected_tokens: dict[int, float]
    terms: dict[str, Terms]  # "prefill" (every chunk), "draft_step", "verify_K" (one call each)
    assumptions: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "prefill_tok_s": self.prefill_tok_s,
            "ttft_s": self.ttft_s,
            "decode_tok_s": {str(k): v for k, v in self.decode_tok_s.items()},
            "best_depth": self.best_depth,
            "energy_j_per_token": self.energy_j_per_token,
            "battery_pct_per_1k_tokens": self.battery_pct_per_1k_tokens,
            "peak_memory_mb": self.peak_memory_mb,
            "round_ms": {str(k): v for k, v in self.round_ms.items()},
            "draft_step_ms": self.draft_ms,
            "expected_tokens_per_round": {str(k): v for k, v in self.expected_tokens.items()},
            "terms": {name: asdict(t) for name, t in self.terms.items()},
            "assumptions": self.assumptions,
        }


def compute_dtype(unit: DelegateProfile, delegate: str, quant: str) -> str:
    wanted = "fp32" if (delegate == "cpu" and quant == "w4a16") else COMPUTE_DTYPE[delegate]
    if wanted in unit.peak_tops:
        return wanted
    return max(unit.peak_tops, key=unit.peak_tops.__getitem__)  # the unit's fastest path


@dataclass(frozen=True)
class Terms:
    """Where predicted time goes, over one or more calls: each call costs the roofline of its
    linears (those on fewer rows than the call apart) and of its attention (each max(memory,
    compute)), its attention scores, the elements its other kernels write, dispatch and host,
    summed in `seconds`."""

    seconds: float = 0.0
    memory_s: float = 0.0
    compute_s: float = 0.0
    dispatch_s: float = 0.0
    host_s: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    launches: int = 0
    scores_s: float = 0.0
    elements_s: float = 0.0  # elements written by kernels outside the matmuls, where counted

    def __add__(self, other: Terms) -> Terms:
        return Terms(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def slower(self, factor: float) -> Terms:
        """The same work taking `factor` times as long (an engine's factor)."""
        if factor == 1.0:
            return self
        return replace(self, seconds=self.seconds * factor, memory_s=self.memory_s * factor,
                       compute_s=self.compute_s * factor, dispatch_s=self.dispatch_s * factor,
                       host_s=self.host_s * factor, scores_s=self.scores_s * factor,
                       elements_s=self.elements_s * factor)  # fmt: skip


def call_terms(
    work: Work,
    unit: DelegateProfile,
    dtype: str,
    launches: int,
    portable: int = 0,
    elementwise: int = 0,
    linears: int = 0,
    nodes: int = 0,
    moved: int = 0,
    float_flops: int = 0,
) -> Terms:
    """One program call as its kernels run, one after another: the linears' roofline (weights
    streamed, or FLOPs in the compute dtype and their activation elements at the profile's
    `ns_per_linear_element`; on a verify's few rows or one, one row's elements at
    `ns_per_gemv_element` beside the weights; those on fewer rows than the call, a pruned
    prefill's KV-shared layers and head, by their own), the attention's (K/V streamed, or FLOPs
    in the activation dtype) plus its scores' time, the `portable` elements fallback kernels
    write in slot bookkeeping and the `moved` ones they copy, the `elementwise` elements its
    other non-matmul kernels write (where the bundle counts them), dispatch (of which `nodes`
    launches are not matmuls, at the profile's `node_us`), and the fixed cost of each of its
    `linears` kernels (where counted). `float_flops`: the FLOPs of linears the program runs in
    the activation dtype besides the model's own (an ExecuTorch program's Q4_0 offset pairs and
    norm means), at that dtype's peak. Weights and K/V that fit the profile's `resident_mb`
    stream at a rate between its resident and memory rates, by their size (`cache_rate`)."""
    bandwidth = rows_rate(unit.memory_bandwidth_gbs, unit.verify_bandwidth_gbs, work.rows)
    resident = unit.resident_bandwidth_gbs
    if resident:
        resident = rows_rate(resident, unit.resident_verify_bandwidth_gbs, work.rows)
    if unit.resident_mb and resident:
        working_mb = (work.weight_bytes + work.cache_bytes) / 2**20
        bandwidth = cache_rate(working_mb, unit.resident_mb, resident, bandwidth)
    weights = (work.weight_bytes - work.few_rows_bytes) / (bandwidth * 1e9)
    few_rows = work.few_rows_bytes / (bandwidth * 1e9)
    kv_bandwidth = unit.attention_bandwidth_gbs or unit.memory_bandwidth_gbs
    kv = work.cache_bytes / (kv_bandwidth * 1e9)
    tops = unit.peak_tops[dtype]
    attention_dtype = ACTIVATION_DTYPE.get(unit.name, "fp16")
    if attention_dtype not in unit.peak_tops:
        attention_dtype = max(unit.peak_tops, key=unit.peak_tops.__getitem__)
    linear = work.flops - work.attention_flops - work.few_rows_flops
    if unit.few_rows_tops and 1 <= work.rows <= VERIFY_ROWS:
        # a few-row kernel (fitted apart) unpacks each weight once, for its first row; each
        # further row costs what a GEMM's does
        first = linear / work.rows
        linear = first / (unit.few_rows_tops * 1e12) + (linear - first) / (tops * 1e12)
    else:
        linear = linear / (tops * 1e12)
    linear += work.linear_elements * (unit.ns_per_linear_element or 0.0) * 1e-9
    linear += float_flops / (unit.peak_tops[attention_dtype] * 1e12)
    few_rows_linear = work.few_rows_flops / (unit.peak_tops[dtype] * 1e12)
    if work.rows <= VERIFY_ROWS:  # a decode step's or a verify's linears: one row's elements,
        # whatever the few rows (a narrow linear's fixed work is the same on 1 row or 4)
        row_elements = work.linear_elements / max(work.rows, 1)
        weights += row_elements * (unit.ns_per_gemv_element or 0.0) * 1e-9
    attention_tops = unit.attention_tops or unit.peak_tops[attention_dtype]
    attention = work.attention_flops / (attention_tops * 1e12)
    scores = work.scores * (unit.ns_per_score or 0.0) * 1e-9
    dispatches = launches if unit.dispatch_unit == "kernel" else 1
    light = min(nodes, dispatches) if unit.node_us is not None else 0
    dispatch = (unit.call_us or 0.0) + (dispatches - light) * unit.dispatch_us
    dispatch = (dispatch + light * (unit.node_us or 0.0)) * 1e-6
    dispatch += linears * (unit.linear_us or 0.0) * 1e-6
    elements = portable * (unit.ns_per_portable_element or 0.0) * 1e-9
    elements += moved * MOVED_BYTES / (unit.memory_bandwidth_gbs * 1e9)
    elements += elementwise * (unit.ns_per_element or 0.0) * 1e-9
    seconds = max(weights, linear) + max(few_rows, few_rows_linear) + max(kv, attention)
    seconds += scores + elements + dispatch
    return Terms(seconds, weights + few_rows + kv, linear + few_rows_linear + attention, dispatch,
                 0.0, work.bytes, work.flops, dispatches, scores, elements)  # fmt: skip


def q4_0_kernel(unit: DelegateProfile, dtype: str, measured: dict[str, Any]) -> DelegateProfile:
    """`unit` as edgemtp's Q4_0 kernel computes a step's linears, from its profile section
    (`measured`): its few rows at the FLOP rate its `VERIFY_PROBE_ROWS`-row probe achieved (2
    FLOPs per weight and row at `verify_bandwidth_gbs`' Q4_0 bytes: it computes each row beside
    reading the weights once), each row's elements at its `ns_per_gemv_element`; XNNPACK's
    GEMM peak and element cost, which the executorch section holds, are not this kernel's."""
    if "verify_bandwidth_gbs" not in measured:
        return unit
    weights_per_s = measured["verify_bandwidth_gbs"] * 1e9 / (BITS_PER_WEIGHT["q4_0"] / 8)
    tops = 2 * VERIFY_PROBE_ROWS * weights_per_s / 1e12
    return replace(
        unit,
        peak_tops={**unit.peak_tops, dtype: tops},
        ns_per_linear_element=measured.get("ns_per_gemv_element"),
    )


def rows_rate(one_row: float, verify: float | None, rows: int) -> float:
    """GB/s a linear streams its weights at on `rows` rows, from its one-row rate and its rate
    on `VERIFY_PROBE_ROWS` (None: the one-row rate on every row count): between them the time
    per byte grows by the same step each row (a few-row kernel reads each weight once and
    computes each row beside it); from the probe's rows to `VERIFY_ROWS`, the probe's rate; a
    prompt chunk's many rows stream at the one-row rate (their FLOPs price them)."""
    if not verify or not 2 <= rows <= VERIFY_ROWS:
        return one_row
    if rows >= VERIFY_PROBE_ROWS:
        return verify
    step = (1 / verify - 1 / one_row) / (VERIFY_PROBE_ROWS - 1)
    return 1 / (1 / one_row + (rows - 1) * step)


RESIDENT_PROBE_MB = 4.5  # what `devices calibrate` measures the resident rates on (8 int4
# linears of 1024 x 1024: codes and bf16 scales), where the cache allows it


def cache_rate(working_mb: float, limit_mb: float, resident: float, memory: float) -> float:
    """GB/s at which a call streams a working set of `working_mb`: the resident rate up to the
    size it was measured on, the memory rate from `limit_mb` (half the last-level cache) on,
    and between them a time per byte interpolated in log size: the measured rate falls
    gradually with the working set, and a step at half the cache predicted mid-sized models
    far too fast (benchmarks/README.md, "The simulator against this host")."""
    far = past_cache(working_mb, limit_mb)
    return 1 / ((1 - far) / resident + far / memory)


def past_cache(working_mb: float, limit_mb: float) -> float:
    """How far a working set of `working_mb` is from staying in the cache between calls: 0 up
    to the resident probe's size, 1 from `limit_mb` on, in log size between them."""
    low = min(RESIDENT_PROBE_MB, limit_mb)
    if working_mb <= low:
        return 0.0
    if working_mb >= limit_mb:
        return 1.0
    return math.log(working_mb / low) / math.log(limit_mb / low)


def host_call_us(unit: DelegateProfile, work: Work) -> float:
    """The host's own time around one call: `host_call_us` where the program streams past the
    cache between the host's turns, `resident_host_call_us` where its weights and K/V stay
    (the host's tables and buffers stay too), between them as `cache_rate` interpolates."""
    cold = unit.host_call_us or 0.0
    if unit.resident_host_call_us is None or not unit.resident_mb:
        return cold
    far = past_cache((work.weight_bytes + work.cache_bytes) / 2**20, unit.resident_mb)
    return unit.resident_host_call_us + far * (cold - unit.resident_host_call_us)


def call_seconds(work: Work, unit: DelegateProfile, dtype: str, launches: int) -> float:
    return call_terms(work, unit, dtype, launches).seconds


def _host(seconds: float) -> Terms:
    return Terms(seconds=seconds, host_s=seconds)


def _launches(model: Model, method: str, layers: int) -> int:
    return model.launches.get(method) or OPS_PER_LAYER * layers


def _kernel_counts(model: Model, method: str) -> tuple[int, int, int, int, int, int]:
    """(portable bookkeeping, other non-matmul) elements one call of `method` writes, its linear
    kernels, its launches that are not matmuls, the elements its portable kernels copy and the
    FLOPs of its float linears, as its bundle says."""
    return (
        model.portable.get(method, 0),
        model.elementwise.get(method, 0),
        model.linears.get(method, 0),
        model.nodes.get(method, 0),
        model.moved.get(method, 0),
        model.float_flops.get(method, 0),
    )


@dataclass(frozen=True)
class Rates:
    """What a runtime achieves on one delegate of a device (fitted to published figures,
    `devices/fit.py`): the unit's rates and launch costs, and the engine's factor on time."""

    unit: DelegateProfile
    engine: str
    engine_factor: float
    source: str


@dataclass(frozen=True)
class Call:
    """One program call, before pricing: its work, launches and kernel counts, the rows the
    host feeds it and the rows it chooses a token from."""

    work: Work
    launches: int
    counts: tuple[int, int, int, int, int, int]
    rows: int
    logits: int


@dataclass(frozen=True)
class Plan:
    """Every call a prompt and a decode round at each depth make: what `price` prices on any
    unit (the fit prices one plan under many rates)."""

    prefill: tuple[Call, ...]
    draft: Call | None
    verify: dict[int, Call]
    middle: int  # the decode position priced: the middle of the generated span
    vocab: int  # rows a token is chosen from


def plan_calls(model: Model, depths: tuple[int, ...], prompt: int, gen: int) -> Plan:
    """The calls a prompt of `prompt` tokens takes, chunk by chunk, and one decode round at each
    depth (a drafter step, a verify) in the middle of `gen` generated tokens."""
    cfg, layers = model.target, model.target.num_layers
    prefill = []
    for start, end in prefill_chunks(prompt, model.chunk):
        rows = range(start, end)
        last = end == prompt
        method, keys = model.prefill(last, end)
        if model.dynamic_cache:
            keys = model.dynamic_keys(start)
        shared = int(last) if model.pruned_prefill else len(rows)
        work = forward_work(cfg, rows, shared, int(last), model.bits, keys, model.cache_itemsize)
        owned = layers if (last or not model.pruned_prefill) else cfg.first_shared_layer
        launches = _launches(model, method, owned)
        prefill.append(Call(work, launches, _kernel_counts(model, method), len(rows), int(last)))

    middle = prompt + gen // 2
    draft = None
    if model.drafter is not None:
        keys = model.dynamic_keys(middle) if model.dynamic_cache else model.cache_keys(middle)
        step = draft_work(
            model.drafter, cfg, middle, model.step_bits, keys, model.full_drafter_head,
            model.cache_itemsize,
        )  # fmt: skip
        n = model.drafter.text.num_layers
        launches = _launches(model, "draft_step", n)
        draft = Call(step, launches, _kernel_counts(model, "draft_step"), 1, 1)
    verify = {}
    for k in depths:
        method, rows = model.verify(k)
        if model.dynamic_cache:
            keys = model.dynamic_keys(middle)
        else:
            keys = model.cache_keys(middle + rows, rows)
        span = range(middle, middle + rows)
        work = forward_work(cfg, span, rows, rows, model.step_bits, keys, model.cache_itemsize)
        launches = _launches(model, method, layers)
        verify[k] = Call(work, launches, _kernel_counts(model, method), k + 1, k + 1)
    return Plan(tuple(prefill), draft, verify, middle, cfg.vocab_size)


def price(call: Call, unit: DelegateProfile, dtype: str, vocab: int, factor: float = 1.0) -> Terms:
    """One call on `unit`: its kernels (`call_terms`) and the host's time around it (per call,
    per row beyond the first, per logit row chosen from), times the engine's `factor`."""
    host = host_call_us(unit, call.work) + (call.rows - 1) * (unit.host_us_per_row or 0.0)
    host = host * 1e-6 + call.logits * (unit.host_ns_per_logit or 0.0) * 1e-9 * vocab
    terms = call_terms(call.work, unit, dtype, call.launches, *call.counts) + _host(host)
    return terms.slower(factor)


def simulate(
    model: Model,
    device: DeviceProfile,
    delegate: str,
    depths: tuple[int, ...],
    acceptance: Acceptance,
    prompt: int,
    gen: int,
    rates: Rates | None = None,
) -> Prediction:
    """Prefill, decode at each depth, energy and memory of `model` on a delegate of `device`:
    with the profile's own numbers, or, given `rates`, with what a runtime achieves there."""
    if delegate not in device.delegates:
        raise EdgeMTPError(
            f"{device.name} has no '{delegate}' delegate in its profile (it has "
            f"{', '.join(device.delegates)})"
        )
    if depths != (0,) and model.drafter is None:
        raise EdgeMTPError("MTP depths need a drafter; this model has none (use --mtp 0)")
    if model.verify_depths and max(depths) > max(model.verify_depths):
        raise EdgeMTPError(
            f"--mtp {max(depths)}: this bundle verifies at most {max(model.verify_depths)} "
            "drafts (export it with a larger --draft-depth)"
        )
    if prompt + gen + max(depths) + 1 > model.max_context:
        raise EdgeMTPError(
            f"--prompt {prompt} + --gen {gen} do not fit the context of {model.max_context}"
        )
    unit = device.delegates[delegate].for_backend(model.backend)
    factor = 1.0
    if rates is not None:
        unit, factor = rates.unit, rates.engine_factor
    dtype = compute_dtype(unit, delegate, model.quant)
    step_unit = unit
    kernels = device.delegates[delegate].backends.get(model.step_kernels or "")
    if rates is None and kernels:
        step_unit = device.delegates[delegate].for_backend(model.backend, model.step_kernels)
        step_unit = q4_0_kernel(step_unit, dtype, kernels)
    cfg = model.target
    plan = plan_calls(model, depths, prompt, gen)

    prefill = Terms()
    for call in plan.prefill:
        prefill += price(call, unit, dtype, plan.vocab, factor)
    prefill_s = prefill.seconds
    middle = plan.middle
    terms = {"prefill": prefill}
    draft_s = 0.0
    if plan.draft is not None:
        terms["draft_step"] = price(plan.draft, step_unit, dtype, plan.vocab, factor)
        draft_s = terms["draft_step"].seconds
    round_s: dict[int, float] = {}
    for k in depths:
        terms[f"verify_{k}"] = price(plan.verify[k], step_unit, dtype, plan.vocab, factor)
        round_s[k] = terms[f"verify_{k}"].seconds + k * draft_s
    expected = {k: acceptance.expected_tokens(k) for k in depths}
    decode = {k: expected[k] / round_s[k] for k in depths}
    best = max(decode, key=lambda k: (decode[k], -k))
    power = unit.idle_w + unit.active_w
    joules = power / decode[best]
    battery = None
    if device.battery_wh:
        battery = 1000 * joules / (device.battery_wh * 3600) * 100
    cache = cache_bytes(cfg, model.max_context, max(depths), model.cache_itemsize)
    peak_mb = (model.program_bytes + cache) / 2**20 + RUNTIME_OVERHEAD_MB
    return Prediction(
        prefill_tok_s=prompt / prefill_s,
        ttft_s=prefill_s,
        decode_tok_s=decode,
        best_depth=best,
        energy_j_per_token=joules,
        battery_pct_per_1k_tokens=battery,
        peak_memory_mb=peak_mb,
        round_ms={k: 1000 * s for k, s in round_s.items()},
        draft_ms=1000 * draft_s,
        expected_tokens=expected,
        terms=terms,
        assumptions={
            "device": f"{device.name} ({device.key})",
            "delegate": f"{delegate}: {unit.unit}",
            "model": model.source,
            "compute_dtype": dtype,
            "memory_bandwidth_gbs": unit.memory_bandwidth_gbs,
            "peak_tops": unit.peak_tops[dtype],
            "numbers": rates.source
            if rates is not None
            else f"the profile's {model.backend} section for {delegate}"
            if model.backend in device.delegates[delegate].backends
            else f"the profile's {delegate} delegate",
            "step_kernels": "the decode, verify and draft steps' linears at the profile's "
            "kernels section (edgemtp's Q4_0 kernel)"
            if rates is None and model.step_kernels in device.delegates[delegate].backends
            else "the steps' linears at the same numbers",
            "engine": f"{rates.engine}, x{rates.engine_factor:.3g} time"
            if rates is not None
            else "the profile's numbers as they are (no engine factor)",
            "dispatch": f"{unit.call_us or 0:.3g} us per call + {unit.dispatch_us:.3g} us per "
            f"{unit.dispatch_unit}"
            + (f" + {unit.linear_us} us per linear kernel" if unit.linear_us else ""),
            "linear_elements": f"{unit.ns_per_linear_element} ns per activation element a "
            "linear reads or writes, beside its FLOPs"
            if unit.ns_per_linear_element is not None
            else "free: the linears' FLOPs at the peak alone",
            "gemv_elements": f"{unit.ns_per_gemv_element} ns per activation element of a "
            "linear on a few rows, beside streaming its weights"
            if unit.ns_per_gemv_element is not None
            else "free: a few rows' linears stream at the bandwidth alone",
            "attention": f"{unit.attention_tops} TFLOPS, {unit.ns_per_score} ns per score, "
            f"K/V at {unit.attention_bandwidth_gbs} GB/s"
            if unit.attention_tops is not None
            else "at the activation dtype's peak and the memory bandwidth, scores free",
            "elements": f"{unit.ns_per_portable_element} ns per portable-kernel element of "
            f"slot bookkeeping, {MOVED_BYTES} bytes per copied one at the memory bandwidth, "
            f"{unit.ns_per_element} ns per other non-matmul element (where the bundle counts them)",
            "host": f"{unit.host_call_us} us per call, {unit.host_us_per_row or 0} us per row "
            f"beyond a call's first, {unit.host_ns_per_logit} ns per logit"
            if unit.host_call_us is not None
            else "not in the profile: program calls priced alone",
            "launches": "operators each of the bundle's methods dispatches"
            if model.launches
            else f"{OPS_PER_LAYER} operators per layer (PEER-90M XNNPACK export)",
            "acceptance": acceptance.source,
            "decode_position": middle,
            "power_w": power,
            "peak_memory": f"program and tables {model.program_bytes / 2**20:.0f} MiB + KV "
            f"cache {cache / 2**20:.0f} MiB + runtime {RUNTIME_OVERHEAD_MB:.0f} MiB (estimate)",
            "estimated_profile_numbers": device.estimates(),
        },
    )


def stored_bytes(cfg: TextConfig, drafter: AssistantConfig | None, quant: str) -> float:
    """Weights of a preset as a bundle stores them: int4 linears and LM head, Q4_0 token table
    (the tied head), int8 per-layer table."""
    table = cfg.vocab_size * cfg.hidden_size * BITS_PER_WEIGHT["q4_0"] / 8
    ple = cfg.vocab_size_per_layer_input * cfg.num_layers * cfg.hidden_size_per_layer_input
    linears = linear_weights(cfg, drafter) - cfg.hidden_size * cfg.vocab_size
    return linears * BITS_PER_WEIGHT[quant] / 8 + table + ple


def cache_itemsize(manifest: dict[str, Any]) -> int:
    """Bytes a K/V element of the bundle's cache takes: 4, float16's 2, or int8's 1 (its rows'
    scales counted by `row_width`)."""
    buffers = manifest["cache"]["buffers"]
    return min(np.dtype(b["dtype"]).itemsize for b in buffers if b["name"][0] in "kv")


def model_from_bundle(bundle: Path) -> Model:
    """A bundle's configs, shapes, stored bytes and the operators of each of its methods."""
    from edgemtp.model.checkpoint import drafter_config, target_config
    from edgemtp.runtime.bundle import read_manifest

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    cfg = target_config(json.loads((bundle / "config.json").read_text()), str(bundle))
    drafter = None
    if manifest["drafter"]:
        raw = json.loads((bundle / manifest["drafter"]["config"]).read_text())
        drafter = drafter_config(raw, str(bundle))
    launches, nodes = method_operators(bundle, manifest)
    bookkeeping, moved = portable_elements(manifest)
    scheme = manifest["quantization"]["scheme"]
    quant = scheme if scheme in BITS_PER_WEIGHT else "fp32" if scheme == "none" else "q4_0"
    shapes = manifest["shapes"]
    return Model(
        cfg,
        drafter,
        quant,
        shapes["chunk"],
        shapes["max_context"],
        sum(f["bytes"] for f in manifest["files"].values()),
        launches,
        f"bundle {bundle} ({manifest['backend']}/{manifest['delegate']}, {scheme})",
        tuple(sorted(int(n.split("_")[1]) for n in manifest["methods"] if _is_verify(n))),
        shapes["max_draft"],
        tuple(shapes["context_buckets"]),
        "over the vocabulary" in manifest["numerics"].get("drafter_head", ""),
        stored_bits(manifest, cfg, drafter),
        manifest["backend"],
        bookkeeping,
        elementwise_elements(manifest),
        {  # ONNX Runtime's 4-bit linear kernel (the one `linear_us` is measured on)
            name: counts.get("MatMulNBits", 0)
            for name, counts in manifest["backend_details"].get("ops", {}).items()
        },
        nodes,
        any(name.startswith("prefill_final_ctx") for name in manifest["methods"]),
        moved,
        float_linear_flops(manifest),
        bool(
            {"edgemtp::cache_attention.out", "edgemtp::cache_attention_rows.out"}
            & set(manifest["backend_details"].get("kernels", []))
        ),
        cache_itemsize(manifest),
        kernel_step_bits(manifest),
    )


def kernel_step_bits(manifest: dict[str, Any]) -> float | None:
    """Bits per linear weight the few-row steps read where edgemtp's Q4_0 kernel runs every
    Q4_0 linear of them (`q4_0_kernel_linears`): 4-bit codes and a float16 scale per block of
    32, no offsets (those stay with the 8da4w form that prompt chunks read). None: as stored."""
    if manifest["backend_details"].get("q4_0_kernel_linears"):
        return BITS_PER_WEIGHT["q4_0"]
    return None


def float_linear_flops(manifest: dict[str, Any]) -> dict[str, int]:
    """Per method, the FLOPs of the float linears an ExecuTorch bundle's delegates run."""
    return {
        name: int(d["float_linear_flops"])
        for name, d in manifest["backend_details"].get("delegation", {}).items()
        if isinstance(d, dict) and "float_linear_flops" in d
    }


def elementwise_elements(manifest: dict[str, Any]) -> dict[str, int]:
    """Per method, the elements its kernels other than matmuls (and portable ones) write per
    call: an ONNX bundle's graph nodes, an ExecuTorch bundle's delegated nodes."""
    details = manifest["backend_details"]
    if "elementwise_elements" in details:
        return {k: int(v) for k, v in details["elementwise_elements"].items()}
    return {
        name: int(d["delegated_elements"])
        for name, d in details.get("delegation", {}).items()
        if isinstance(d, dict) and "delegated_elements" in d
    }


# Portable kernels that loop over their elements one by one, as the cache's slot bookkeeping
# `devices calibrate` times (ns_per_portable_element); the others move data (copies, gathers,
# concatenations, cache writes: MOVED_BYTES per element at the memory bandwidth), far faster
# per element than the bookkeeping rate would price them.
BOOKKEEPING_OPS = {"eq", "ne", "lt", "le", "gt", "ge", "where", "remainder", "add", "sub", "mul",
                   "div", "min", "max", "arange", "cumsum"}  # fmt: skip
MOVED_BYTES = 8  # an fp32 element read and written


def portable_elements(manifest: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Per method, the elements its portable kernels write per call: (bookkeeping, moved).
    Bundles that did not record them per op count every element as bookkeeping."""
    bookkeeping: dict[str, int] = {}
    moved: dict[str, int] = {}
    for name, d in manifest["backend_details"].get("delegation", {}).items():
        if not isinstance(d, dict) or "portable_elements" not in d:
            continue
        by_op = d.get("portable_elements_by_op")
        if by_op is None:
            bookkeeping[name] = int(d["portable_elements"])
            continue
        bookkeeping[name] = sum(int(n) for op, n in by_op.items() if _bookkeeping(op))
        moved[name] = sum(int(n) for op, n in by_op.items() if not _bookkeeping(op))
    return bookkeeping, moved


def _bookkeeping(op: str) -> bool:
    kind = op.split(".")[-2] if "." in op else op  # "aten.lt.Tensor" -> "lt"
    return kind in BOOKKEEPING_OPS or kind.startswith(("bitwise_", "logical_"))


GROUP = {"q4_0": 32, "w4a16": 128}  # weights per scale


def stored_bits(
    manifest: dict[str, Any], cfg: TextConfig, drafter: AssistantConfig | None
) -> float | None:
    """Bits per 4-bit linear weight as the bundle's program stores them: an ExecuTorch program
    4-bit codes, a bf16 scale per group and, in every linear with a block that needs an offset
    (negative Q4_0 scales, zero points other than 8), an fp32 offset per block of it
    (`offset_values`; bundles that only counted the blocks needing one, `offset_blocks`,
    stored them the same way: Q4_0 from llama.cpp has such a block in nearly every linear, so
    those count as one per block); ONNX MatMulNBits 4-bit codes, an fp32 scale per group and
    4-bit zero points when asymmetric. None: the scheme's nominal."""
    scheme = manifest["quantization"]["scheme"]
    group = GROUP.get(scheme)
    if group is None:
        return None
    if manifest["backend"] == "executorch":
        details, weights = manifest["backend_details"], linear_weights(cfg, drafter)
        offsets = details.get("offset_values")
        if offsets is None:
            offsets = weights / group if details.get("offset_blocks") else 0
        return 4 + 16 / group + 32 * offsets / weights
    if manifest["backend"] == "onnx":
        return 4 + 32 / group + (4 / group if scheme == "w4a16" else 0)
    return None


def linear_weights(cfg: TextConfig, drafter: AssistantConfig | None) -> int:
    """Weights of every linear the programs hold: the target's layers, per-layer input
    projection and LM head, the drafter's layers, projections, LM head and (clustered head)
    centroids."""
    total = sum(layer_weights(cfg, spec) for spec in cfg.layers) + cfg.hidden_size * cfg.vocab_size
    if cfg.hidden_size_per_layer_input:
        total += cfg.hidden_size * cfg.num_layers * cfg.hidden_size_per_layer_input
    if drafter is not None:
        text = drafter.text
        total += sum(layer_weights(text, spec) for spec in text.layers)
        total += 3 * drafter.backbone_hidden_size * text.hidden_size
        total += text.hidden_size * text.vocab_size
        if drafter.use_ordered_embeddings:
            total += text.hidden_size * drafter.num_centroids
    return total


PROGRAM_READ_LIMIT = 2**30  # older ExecuTorch bundles: count operators from programs this small


def method_operators(
    bundle: Path, manifest: dict[str, Any]
) -> tuple[dict[str, int], dict[str, int]]:
    """Operators each method dispatches per call, and how many of them are XNNPACK nodes other
    than matmuls (priced at the profile's `node_us`; ExecuTorch bundles only). An ExecuTorch
    bundle's `runtime_ops` (portable kernel calls plus XNNPACK graph nodes) and their kinds,
    counted from the program itself when an older export did not record them; an ONNX
    method's graph nodes; else the exported graph's node count, or nothing (then
    OPS_PER_LAYER)."""
    delegation = manifest["backend_details"].get("delegation", {})
    kinds: dict[str, dict[str, int]] | None = None
    if delegation and all("runtime_op_kinds" in d for d in delegation.values()):
        kinds = {name: d["runtime_op_kinds"] for name, d in delegation.items()}
    program = bundle / manifest["program"]
    if kinds is None and manifest["backend"] == "executorch":
        if program.stat().st_size < PROGRAM_READ_LIMIT:
            from executorch.exir._serialize._program import deserialize_pte_binary

            from edgemtp.export.executorch import program_operator_kinds

            kinds = program_operator_kinds(deserialize_pte_binary(program.read_bytes()).program)
    if kinds is not None:
        from edgemtp.export.executorch import XNNPACK_MATMUL_NODES

        light = {k for c in kinds.values() for k in c if k.startswith("XNN")}
        light -= set(XNNPACK_MATMUL_NODES)
        other = {name: sum(n for k, n in c.items() if k in light) for name, c in kinds.items()}
        return {name: sum(c.values()) for name, c in kinds.items()}, other
    if delegation and all("runtime_ops" in d for d in delegation.values()):
        return {name: int(d["runtime_ops"]) for name, d in delegation.items()}, {}
    if manifest["backend"] == "onnx":
        import onnx

        from edgemtp.runtime.runners.onnx import INDEX

        methods = json.loads((program / INDEX).read_text())["methods"]
        return {
            name: len(onnx.load(program / m["file"], load_external_data=False).graph.node)
            for name, m in methods.items()
        }, {}
    return {
        name: int(d.get("delegated_nodes", 0)) + int(d.get("portable_nodes", 0))
        for name, d in delegation.items()
        if isinstance(d, dict)
    }, {}


def _is_verify(method: str) -> bool:
    return method.startswith("verify_") and "_ctx" not in method


def model_from_preset(
    preset: str,
    quant: str,
    max_context: int,
    chunk: int,
    max_draft: int = 4,
    buckets: tuple[int, ...] = (),
) -> Model:
    """A full-size preset (e2b, e4b, ...) with its assistant, as an export would store it
    (`buckets`: the context buckets an ExecuTorch cpu export gets)."""
    from edgemtp.model.checkpoint import drafter_config, target_config
    from edgemtp.model.synth import PRESETS, preset_config

    if preset not in PRESETS:
        raise EdgeMTPError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    cfg = target_config(preset_config(preset), preset)
    drafter = None
    if f"{preset}-assistant" in PRESETS:
        drafter = drafter_config(preset_config(f"{preset}-assistant"), preset)
    stored = stored_bytes(cfg, drafter, quant)
    depth = max_draft if drafter is not None else 0
    source = f"preset {preset} {quant}, as exported with --max-context {max_context}"
    return Model(cfg, drafter, quant, chunk, max_context, stored, {}, source, (0, depth), depth,
                 buckets)  # fmt: skip
