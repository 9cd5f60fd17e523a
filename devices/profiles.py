"""Device profiles: the hardware facts the host-side simulator predicts speed and battery from.

One TOML file per device in `devices/profiles/`. Every number in a profile is an inline table

    { value = X, source = "URL or document title", note = "how X follows from the source" }

or, where no public figure exists,

    { value = X, source = "estimate", note = "from which public facts, with the arithmetic" }

so each number can be traced; `DeviceProfile.sources` maps a dotted field path
("delegates.cpu.memory_bandwidth_gbs") to its `(source, note)`. A number that any assumption
went into is an "estimate", even when most of its inputs are sourced.

No profile number is fitted to a published LLM speed (tokens/s): the simulator is checked against
those, so the profiles hold hardware specifications and generic microbenchmarks only.

What the fields mean (the simulator relies on these definitions):

- `ram_gb`: installed memory of the profiled configuration.
- `battery_wh`: usable pack energy (rated mAh x nominal V); the string "mains" for a device with
  no battery (then `DeviceProfile.battery_wh` is None).
- `idle_w`: whole-device power while idle in the state a benchmark runs in (screen on at low
  brightness on phones and laptops, headless for boards). A delegate may override it.
- per delegate (`cpu`, `gpu`, `metal`, `npu`, `htp`):
  - `memory_bandwidth_gbs`: what that unit can really stream from DRAM, sustained (STREAM-like),
    always <= `peak_memory_bandwidth_gbs`, the theoretical bus peak (MT/s x bus bytes).
  - `peak_tops`: peak dense throughput per dtype (`int4`, `int8`, `fp16`, `fp32`) in TOPS/TFLOPS
    counting a multiply-add as two operations, over the cores the runtime uses (`threads`).
    A dtype is absent where the unit has no native path for it.
  - `dispatch_us`: fixed cost of one launch, where `dispatch_unit` says what one launch is:
    "kernel" (one operator, CPU/GPU) or "graph" (one whole compiled graph/predict call, NPUs).
  - `active_w`: increase in whole-device power over `idle_w` while this unit runs the model flat
    out, sustained after thermal settling, including its DRAM and fabric traffic.
    Energy = (idle_w + active_w) x time. `peak_w`, where given, is a published burst figure.
  - `threads`: worker threads (cores) the runtime uses on a CPU delegate.
  - `call_us` (optional): fixed cost of one program call, beside its launches.
  - `verify_bandwidth_gbs` (optional): the rate 4-bit weights stream at through a linear on
    4 rows (a verify of 3 drafts), where a kernel takes another path than for one row or does
    work per row beside reading its weights once. A call of 2 or 3 rows is priced between the
    two rates (the time per byte grows by the same step each row), one of 5-16 rows at it.
  - `attention_tops`, `attention_bandwidth_gbs`, `ns_per_score` (optional): how the unit's
    attention kernels run: the FLOP rate of its batched matmuls (activations x activations),
    the rate K/V stream through them (which may repack them every call), and the time per
    attention score (per head, row and key) its mask, softmax and the copies between them
    take. Absent: the activation dtype's peak, `memory_bandwidth_gbs`, and scores for free.
  - `ns_per_portable_element` (optional): time per element a runtime's fallback kernels write
    (ExecuTorch's portable kernels: the ops no delegate takes); a bundle records how many
    elements each method's such ops write. Absent: free.
  - `ns_per_element` (optional): time per element the unit's kernels other than matmuls write
    (norms, activations, adds, copies), for bundles that record them per method (ONNX graph
    nodes; ExecuTorch's delegated nodes). Absent: free.
  - `linear_us` (optional): fixed time of one linear kernel beyond streaming its weights and
    its launch (a kernel's per-call setup: quantizing the activation row, its workspace), for
    bundles that count their linear kernels per method (ONNX). Absent: free.
  - `ns_per_linear_element` (optional): time per activation element a linear kernel reads or
    writes (rows x (inputs + outputs)) beside its FLOPs at `peak_tops` (quantizing its input
    rows, writing its output): what makes a GEMM over narrow matrices slower per FLOP than a
    wide one. Absent: free.
  - `ns_per_gemv_element` (optional): the same for a linear on one row or a verify's few:
    time per element of one row (inputs + outputs) beside streaming its weights, once per call
    whatever its few rows: a narrow matrix's fixed work the wide streaming probe hides.
    Absent: free.
  - `node_us` (optional): fixed cost of a launch that is not a matmul (elementwise, shape and
    normalization nodes) on a "kernel" unit, where it is far below a matmul's `dispatch_us`;
    for bundles that count their nodes by kind (ExecuTorch's XNNPACK graphs). Absent:
    `dispatch_us` for every launch.
  - `resident_mb`, `resident_bandwidth_gbs`, `resident_verify_bandwidth_gbs` (optional): a
    call whose weights and K/V take less than `resident_mb` stays partly in the last-level
    cache from one call to the next: its 4-bit weights stream at the resident rates (one row;
    a verify's few rows) when they are as small as the rates' probe, and nearer
    `memory_bandwidth_gbs` / `verify_bandwidth_gbs` the closer they come to `resident_mb`
    (`simulator.cache_rate`).
  - `[delegates.X.backends.Y]` (optional): `memory_bandwidth_gbs`, `dispatch_us`, `call_us`,
    `host_*`, the attention numbers and `peak_tops` as the kernels of backend Y (executorch,
    onnx, coreml) run on this unit, where they were measured apart; a bundle of backend Y is
    priced with them. `[delegates.X.backends.kernels]`: the streaming rates of edgemtp's own
    Q4_0 kernel (one row, a verify's rows, from memory and from the cache) and its time per
    element of a narrow row, which the decode, verify and draft steps of an ExecuTorch bundle
    exported with `--kernels edgemtp` run (over the executorch section, for those calls only).
  - `few_rows_tops` (never in a TOML file): the throughput a linear on one row achieves, where it
    is not `peak_tops`' (a GEMV's kernel unpacks every weight for one row); on a verify's few
    rows the first pays it and the others `peak_tops`. Only rates fitted to published figures
    set it (`devices/fit.py`); absent: `peak_tops`.
  - `host_call_us`, `host_ns_per_logit`, `host_us_per_row` (optional): the runtime host's own
    time around each program call (gathering table rows, building inputs, the decode loop), per
    logit it chooses a token from, and per row a call carries beyond its first (a prefill
    chunk's, a verify's table gathers and input copies). Measured for edgemtp's Python host by
    `devices calibrate`; absent, the simulator prices the program calls alone and says so.
    `host_call_us` is measured beside a program that streams past the cache between the
    host's turns; `resident_host_call_us` (optional) beside one whose data stays in it, so the
    host finds its own tables and buffers there too (a small model's calls; between the two
    as the call's weights and K/V near `resident_mb`).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgemtp.errors import EdgeMTPError, malformed_input

PROFILE_DIR = Path(__file__).parent / "profiles"
USER_PROFILE_DIR = Path.home() / ".cache" / "edgemtp" / "profiles"  # `devices calibrate` writes
DELEGATES = ("cpu", "gpu", "metal", "npu", "htp")
DTYPES = ("int4", "int8", "fp16", "fp32")
DISPATCH_UNITS = ("kernel", "graph")
ESTIMATE = "estimate"
MAINS = "mains"
MIN_NOTE_CHARS = 12  # a note must say something: "how X follows", not "see above"

_TOP_REQUIRED = {"name": str, "soc": str, "memory": str}
_TOP_NUMBERS = ("ram_gb", "idle_w")
_DELEGATE_NUMBERS = ("memory_bandwidth_gbs", "peak_memory_bandwidth_gbs", "dispatch_us", "active_w")
_DELEGATE_OPTIONAL_NUMBERS = (
    "threads", "idle_w", "peak_w", "host_call_us", "host_ns_per_logit", "host_us_per_row",
    "resident_host_call_us",
    "call_us", "verify_bandwidth_gbs", "attention_tops", "attention_bandwidth_gbs",
    "ns_per_score", "ns_per_portable_element", "ns_per_element", "linear_us", "node_us",
    "resident_mb", "resident_bandwidth_gbs", "resident_verify_bandwidth_gbs",
    "ns_per_linear_element", "ns_per_gemv_element",
)  # fmt: skip
# bundle backends, and "kernels": edgemtp's own kernels where an ExecuTorch bundle's steps run them
BACKENDS = ("executorch", "onnx", "coreml", "kernels")
# what a [delegates.X.backends.Y] section may replace for bundles of backend Y
_BACKEND_NUMBERS = (
    "memory_bandwidth_gbs", "verify_bandwidth_gbs", "dispatch_us", "call_us", "host_call_us",
    "host_ns_per_logit", "host_us_per_row", "attention_tops", "attention_bandwidth_gbs",
    "ns_per_score", "ns_per_element", "linear_us", "node_us", "resident_bandwidth_gbs",
    "resident_verify_bandwidth_gbs", "ns_per_linear_element", "ns_per_gemv_element",
)  # fmt: skip
_FIX = "see the field conventions at the top of devices/profiles.py"


@dataclass(frozen=True)
class DelegateProfile:
    name: str
    unit: str  # what the delegate runs on, in words ("Adreno 840 GPU, 1.2 GHz")
    dispatch_unit: str  # "kernel" or "graph": what one dispatch_us pays for
    memory_bandwidth_gbs: float  # sustained
    peak_memory_bandwidth_gbs: float  # theoretical bus peak
    peak_tops: dict[str, float]
    dispatch_us: float
    active_w: float
    idle_w: float
    threads: int | None = None
    peak_w: float | None = None
    host_call_us: float | None = None
    resident_host_call_us: float | None = None
    host_ns_per_logit: float | None = None
    host_us_per_row: float | None = None
    call_us: float | None = None
    verify_bandwidth_gbs: float | None = None
    attention_tops: float | None = None
    attention_bandwidth_gbs: float | None = None
    ns_per_score: float | None = None
    ns_per_portable_element: float | None = None
    ns_per_element: float | None = None
    linear_us: float | None = None
    node_us: float | None = None
    resident_mb: float | None = None
    resident_bandwidth_gbs: float | None = None
    resident_verify_bandwidth_gbs: float | None = None
    ns_per_linear_element: float | None = None
    ns_per_gemv_element: float | None = None
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)
    few_rows_tops: float | None = None  # fitted rates only (devices/fit.py)

    def for_backend(self, *backends: str | None) -> DelegateProfile:
        """This unit as a bundle of `backends` sees it (each over the one before: a bundle's
        backend, then the kernels its steps run): their bandwidth, throughput and dispatch
        where the profile measured them apart."""
        unit = self
        for backend in backends:
            changes = self.backends.get(backend or "", {})
            if changes:
                tops = changes.get("peak_tops") or unit.peak_tops
                unit = replace(unit, **{**changes, "peak_tops": tops}, backends={})
        return unit


@dataclass(frozen=True)
class DeviceProfile:
    key: str  # file stem, what load_profile takes
    name: str
    soc: str
    memory: str
    ram_gb: float
    battery_wh: float | None  # None: mains-powered
    idle_w: float
    delegates: dict[str, DelegateProfile]
    path: Path
    sources: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)

    def source(self, field_path: str) -> tuple[str, str]:
        """`(source, note)` of one number, by dotted path ("delegates.npu.peak_tops.int8")."""
        try:
            return self.sources[field_path]
        except KeyError:
            known = ", ".join(sorted(self.sources))
            raise EdgeMTPError(
                f"{self.path}: no number at {field_path!r}; known: {known}"
            ) from None

    def estimates(self) -> list[str]:
        """Dotted paths of the numbers that are estimates rather than published figures."""
        return sorted(k for k, (src, _) in self.sources.items() if src == ESTIMATE)


def list_profiles() -> list[str]:
    """Names `load_profile` accepts: the shipped `profiles/*.toml` and the calibrated ones."""
    return sorted({p.stem for d in (PROFILE_DIR, USER_PROFILE_DIR) for p in d.glob("*.toml")})


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A shipped profile by name ("pixel-10-pro") or any profile file by path."""
    path = _resolve(name_or_path)
    with malformed_input(str(path), "device profile (TOML)", _FIX):
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    return _Parser(path).profile(raw)


def _resolve(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.endswith(".toml") or "/" in text or "\\" in text:
        path = Path(name_or_path)
        if not path.is_file():
            raise EdgeMTPError(f"{path}: no such device profile file")
        return path
    path = PROFILE_DIR / f"{text}.toml"
    if not path.is_file():
        path = USER_PROFILE_DIR / f"{text}.toml"
    if not path.is_file():
        raise EdgeMTPError(
            f"unknown device profile {text!r}; known: {', '.join(list_profiles())} "
            "(or pass the path of a .toml profile)"
        )
    return path


class _Parser:
    def __init__(self, path: Path):
        self.path = path
        self.sources: dict[str, tuple[str, str]] = {}

    def fail(self, field_path: str, problem: str) -> EdgeMTPError:
        return EdgeMTPError(f"{self.path}: field {field_path}: {problem}; {_FIX}")

    def number(self, table: dict[str, Any], key: str, prefix: str = "") -> float:
        where = f"{prefix}{key}"
        if key not in table:
            raise self.fail(where, "missing")
        return self.sourced(table[key], where)

    def sourced(self, entry: Any, where: str) -> float:
        if not isinstance(entry, dict):
            raise self.fail(
                where,
                f"a bare {type(entry).__name__} {entry!r}; every number must be "
                '{ value = X, source = "...", note = "..." }',
            )
        extra = set(entry) - {"value", "source", "note"}
        if extra:
            raise self.fail(where, f"unknown key(s) {', '.join(sorted(extra))}")
        for key in ("value", "source", "note"):
            if key not in entry:
                raise self.fail(where, f"no {key}")
        value, source, note = entry["value"], entry["source"], entry["note"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(where, f"value must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or value <= 0:
            raise self.fail(where, f"value must be a positive finite number, got {value}")
        if not isinstance(source, str) or not source.strip():
            raise self.fail(where, 'source must name a URL or document title, or be "estimate"')
        if not isinstance(note, str) or len(note.strip()) < MIN_NOTE_CHARS:
            what = "how it was estimated" if source == ESTIMATE else "how the value follows"
            raise self.fail(where, f"note must say {what} (at least {MIN_NOTE_CHARS} characters)")
        self.sources[where] = (source.strip(), " ".join(note.split()))
        return float(value)

    def text(self, table: dict[str, Any], key: str, prefix: str = "") -> str:
        where = f"{prefix}{key}"
        if key not in table:
            raise self.fail(where, "missing")
        if not isinstance(table[key], str) or not table[key].strip():
            raise self.fail(where, f"must be a non-empty string, got {type(table[key]).__name__}")
        return table[key].strip()

    def profile(self, raw: dict[str, Any]) -> DeviceProfile:
        known = set(_TOP_REQUIRED) | set(_TOP_NUMBERS) | {"battery_wh", "delegates"}
        unknown = set(raw) - known
        if unknown:
            raise self.fail(", ".join(sorted(unknown)), "unknown field")
        name, soc, memory = (self.text(raw, k) for k in _TOP_REQUIRED)
        ram_gb, idle_w = (self.number(raw, k) for k in _TOP_NUMBERS)
        if "battery_wh" not in raw:
            raise self.fail("battery_wh", f'missing (a number table, or "{MAINS}" if no battery)')
        battery = raw["battery_wh"]
        battery_wh = None if battery == MAINS else self.sourced(battery, "battery_wh")
        delegates_raw = raw.get("delegates")
        if not isinstance(delegates_raw, dict) or not delegates_raw:
            raise self.fail("delegates", "missing or empty; at least [delegates.cpu]")
        for key in delegates_raw:
            if key not in DELEGATES:
                raise self.fail(
                    f"delegates.{key}", f"unknown delegate; known: {', '.join(DELEGATES)}"
                )
        if "cpu" not in delegates_raw:
            raise self.fail("delegates.cpu", "missing; every device has a CPU delegate")
        delegates = {
            key: self.delegate(key, delegates_raw[key], idle_w)
            for key in DELEGATES
            if key in delegates_raw
        }
        return DeviceProfile(
            key=self.path.stem,
            name=name,
            soc=soc,
            memory=memory,
            ram_gb=ram_gb,
            battery_wh=battery_wh,
            idle_w=idle_w,
            delegates=delegates,
            path=self.path,
            sources=dict(self.sources),
        )

    def delegate(self, key: str, table: Any, device_idle_w: float) -> DelegateProfile:
        prefix = f"delegates.{key}."
        if not isinstance(table, dict):
            raise self.fail(prefix[:-1], f"must be a table, got {type(table).__name__}")
        known = {"unit", "dispatch_unit", "peak_tops", "backends", *_DELEGATE_NUMBERS}
        unknown = set(table) - known - set(_DELEGATE_OPTIONAL_NUMBERS)
        if unknown:
            raise self.fail(prefix + ", ".join(sorted(unknown)), "unknown field")
        unit = self.text(table, "unit", prefix)
        dispatch_unit = self.text(table, "dispatch_unit", prefix)
        if dispatch_unit not in DISPATCH_UNITS:
            raise self.fail(prefix + "dispatch_unit", f"must be one of {', '.join(DISPATCH_UNITS)}")
        bw, peak_bw, dispatch_us, active_w = (
            self.number(table, k, prefix) for k in _DELEGATE_NUMBERS
        )
        if bw > peak_bw:
            raise self.fail(
                prefix + "memory_bandwidth_gbs",
                f"sustained {bw} GB/s exceeds the theoretical peak {peak_bw} GB/s",
            )
        optional = {
            k: self.number(table, k, prefix) for k in _DELEGATE_OPTIONAL_NUMBERS if k in table
        }
        threads = optional.get("threads")
        if threads is not None and threads != int(threads):
            raise self.fail(prefix + "threads", f"must be a whole number, got {threads}")
        peak_tops = self.tops(table.get("peak_tops"), prefix)
        idle_w = optional.get("idle_w")
        if idle_w is None:  # the device's idle power; its source is the device-level one
            idle_w = device_idle_w
            self.sources[prefix + "idle_w"] = self.sources["idle_w"]
        return DelegateProfile(
            name=key,
            unit=unit,
            dispatch_unit=dispatch_unit,
            memory_bandwidth_gbs=bw,
            peak_memory_bandwidth_gbs=peak_bw,
            peak_tops=peak_tops,
            dispatch_us=dispatch_us,
            active_w=active_w,
            idle_w=idle_w,
            threads=None if threads is None else int(threads),
            peak_w=optional.get("peak_w"),
            host_call_us=optional.get("host_call_us"),
            resident_host_call_us=optional.get("resident_host_call_us"),
            host_ns_per_logit=optional.get("host_ns_per_logit"),
            host_us_per_row=optional.get("host_us_per_row"),
            call_us=optional.get("call_us"),
            verify_bandwidth_gbs=optional.get("verify_bandwidth_gbs"),
            attention_tops=optional.get("attention_tops"),
            attention_bandwidth_gbs=optional.get("attention_bandwidth_gbs"),
            ns_per_score=optional.get("ns_per_score"),
            ns_per_portable_element=optional.get("ns_per_portable_element"),
            ns_per_element=optional.get("ns_per_element"),
            linear_us=optional.get("linear_us"),
            node_us=optional.get("node_us"),
            resident_mb=optional.get("resident_mb"),
            resident_bandwidth_gbs=optional.get("resident_bandwidth_gbs"),
            resident_verify_bandwidth_gbs=optional.get("resident_verify_bandwidth_gbs"),
            ns_per_linear_element=optional.get("ns_per_linear_element"),
            ns_per_gemv_element=optional.get("ns_per_gemv_element"),
            backends=self.backends(table.get("backends", {}), prefix),
        )

    def tops(self, raw: Any, prefix: str) -> dict[str, float]:
        if not isinstance(raw, dict) or not raw:
            raise self.fail(
                prefix + "peak_tops", "missing or empty; at least one of " + ", ".join(DTYPES)
            )
        for dtype in raw:
            if dtype not in DTYPES:
                raise self.fail(
                    f"{prefix}peak_tops.{dtype}", f"unknown dtype; known: {', '.join(DTYPES)}"
                )
        return {
            dtype: self.number(raw, dtype, f"{prefix}peak_tops.")
            for dtype in DTYPES
            if dtype in raw
        }

    def backends(self, raw: Any, prefix: str) -> dict[str, dict[str, Any]]:
        """[delegates.X.backends.Y]: numbers measured for bundles of backend Y on this unit."""
        if not isinstance(raw, dict):
            raise self.fail(prefix + "backends", "must be a table of backends")
        out: dict[str, dict[str, Any]] = {}
        for name, table in raw.items():
            where = f"{prefix}backends.{name}."
            if name not in BACKENDS:
                raise self.fail(where[:-1], f"unknown backend; known: {', '.join(BACKENDS)}")
            if not isinstance(table, dict):
                raise self.fail(where[:-1], "must be a table")
            unknown = set(table) - {*_BACKEND_NUMBERS, "peak_tops"}
            if unknown:
                raise self.fail(where + ", ".join(sorted(unknown)), "unknown field")
            out[name] = {k: self.number(table, k, where) for k in _BACKEND_NUMBERS if k in table}
            if "peak_tops" in table:
                out[name]["peak_tops"] = self.tops(table["peak_tops"], where)
        return out
