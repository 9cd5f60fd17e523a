"""A long-lived generation session over a bundle (or the reference checkpoints).

    session = Session.from_bundle("bundle/")            # ExecuTorch, ONNX Runtime or Core ML
    out = session.generate(prompt_ids, 64)               # MTP depth chosen as it runs
    out = session.generate(prompt_ids + out.tokens + more_ids, 64)   # a chat turn: only the
                                                                     # new tokens are prefilled
    session.truncate(n); session.reset()

The session remembers which tokens its cache holds. A prompt that starts with them reuses the
cache and prefills only the rest; one that diverges truncates to the common prefix (or, when a
sliding ring no longer holds that prefix, prefills again from the start).
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgemtp.errors import EdgeMTPError
from edgemtp.runtime.adaptive import AdaptiveDepth
from edgemtp.runtime.backends import Backend, ReferenceBackend, Runner, StaticBackend
from edgemtp.runtime.generate import DepthPolicy, FixedDepth, Generation, decode
from edgemtp.runtime.sampling import SamplingParams
from edgemtp.runtime.tokenizer import PromptTokenizer, load_tokenizer

if TYPE_CHECKING:
    from edgemtp.model.checkpoint import Drafter, Target
    from edgemtp.model.static import StaticShapes


@dataclass
class Session:
    backend: Backend
    tokenizer: PromptTokenizer | None = None
    stop_ids: tuple[int, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)  # what was loaded: backend, delegate, ...
    cached: list[int] = field(default_factory=list)  # the tokens whose K/V the cache holds
    adaptive: AdaptiveDepth | None = None

    def __post_init__(self) -> None:
        if self.backend.has_drafter and self.backend.max_draft:
            self.adaptive = AdaptiveDepth(self.backend.max_draft, self.backend.verify_shape)

    # --- opening -------------------------------------------------------------------------------
    @classmethod
    def from_bundle(
        cls,
        bundle: Path | str,
        *,
        delegate: str | None = None,
        threads: int | None = 1,
        verify: bool = True,
        progress: Callable[[str], None] | None = None,
        weight_cache: bool = True,
    ) -> Session:
        """Load an export bundle. `delegate` overrides the bundle's where the backend can (an
        ONNX htp bundle on the CPU EP, a Core ML bundle on other compute units); `verify`
        checks every file against its SHA-256 in the manifest first; `weight_cache=False`
        leaves ExecuTorch's XNNPACK weight cache off (each method packs its own weights: for
        comparisons only)."""
        from edgemtp.model.checkpoint import target_config
        from edgemtp.model.static import StaticShapes
        from edgemtp.runtime.bundle import (
            SCHEMA_VERSION,
            kv_cache_of,
            open_tables,
            read_manifest,
            verify_files,
        )
        from edgemtp.runtime.capabilities import require

        bundle = Path(bundle)
        if not bundle.is_dir():
            raise EdgeMTPError(f"{bundle}: no such bundle folder (make one with edgemtp export)")
        manifest = read_manifest(bundle)
        say = progress or (lambda _: None)
        if verify:
            say(f"checking {len(manifest['files'])} files against the manifest's SHA-256")
            verify_files(bundle, manifest)
        backend, exported = manifest["backend"], manifest["delegate"]
        delegate = delegate or exported
        _check_delegate_override(backend, exported, delegate)
        require(backend, delegate)
        shapes = StaticShapes.from_manifest(manifest["shapes"])
        cfg = target_config(json.loads((bundle / "config.json").read_text()), str(bundle))
        say(f"loading {manifest['program']} ({backend}/{delegate})")
        program = bundle / manifest["program"]
        runner = open_runner(program, backend, delegate, shapes, threads, weight_cache)
        tables = open_tables(bundle, cfg, manifest["tables"])
        tokenizer = load_tokenizer(bundle)
        stop = (*cfg.eos_token_ids, *(tokenizer.extra_stop_ids if tokenizer else ()))
        info = {
            "bundle": str(bundle),
            "backend": backend,
            "delegate": delegate,
            "quantization": manifest["quantization"]["scheme"],
            "exported_by": f"edgemtp {manifest['edgemtp_version']} (schema {SCHEMA_VERSION})",
            "shapes": manifest["shapes"],
            "weight_cache": getattr(runner, "weight_cache", None),
        }
        kv = kv_cache_of(manifest)
        info["kv_cache"], info["kv_cache_bytes"] = kv["dtype"], kv["bytes"]
        return cls(StaticBackend(runner, tables, cfg, name=backend), tokenizer, stop, info)

    @classmethod
    def from_checkpoints(
        cls, model: Path | str, drafter: Path | str | None = None, **engine: Any
    ) -> Session:
        """The reference engine over a checkpoint folder (and its MTP assistant); `engine`:
        `from_models`' keywords."""
        from edgemtp.quantize.load import load_drafter, load_target

        target = load_target(Path(model))
        helper = load_drafter(Path(drafter), target.cfg) if drafter else None
        return cls.from_models(target, helper, Path(model), **engine)

    @classmethod
    def from_models(
        cls,
        target: Target,
        drafter: Drafter | None,
        folder: Path,
        *,
        max_context: int | None = None,
        max_draft: int = 4,
        prefill_chunk: int = 512,
        prune: bool = True,
        kv_cache: str | None = None,
    ) -> Session:
        """The reference engine over loaded models, in whatever form they were put
        (`Target.use_form`); `folder`: the target's checkpoint, for its tokenizer; `kv_cache`:
        the cache's dtype (`KV_CACHE_DTYPES`; default float32)."""
        backend = ReferenceBackend(
            target,
            drafter,
            max_context=max_context,
            max_draft=max_draft,
            prefill_chunk=prefill_chunk,
            prune=prune,
            kv_cache=kv_cache,
        )
        tokenizer = load_tokenizer(folder)
        stop = (*target.cfg.eos_token_ids, *(tokenizer.extra_stop_ids if tokenizer else ()))
        info = {"model": str(folder), "backend": "reference", "delegate": "cpu"}
        info["kv_cache"] = kv_cache or "fp32"
        info["kv_cache_bytes"] = backend.cache.nbytes()
        return cls(backend, tokenizer, stop, info)

    # --- generating ----------------------------------------------------------------------------
    def policy(self, mtp: int | str) -> DepthPolicy:
        """`"auto"`: the adaptive depth (AR without a drafter); an int pins the depth."""
        if mtp == "auto":
            return self.adaptive if self.adaptive is not None else FixedDepth(0)
        depth = int(mtp)
        if depth and not self.backend.has_drafter:
            raise EdgeMTPError(f"--mtp {depth} needs a drafter; this model has none (use 0)")
        if not 0 <= depth <= self.backend.max_draft:
            raise EdgeMTPError(
                f"--mtp {depth}: this {self.backend.name} model verifies at most "
                f"{self.backend.max_draft} drafts (export with --draft-depth {depth} for more)"
            )
        return FixedDepth(depth)

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        mtp: int | str = "auto",
        params: SamplingParams | None = None,
        stop_ids: tuple[int, ...] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        interruptible: bool = True,
    ) -> Generation:
        """Continue from the longest prefix of `prompt` the cache holds; see the module doc.
        With `interruptible`, a Ctrl-C ends decoding after the round (or the prefill) in flight
        and returns the tokens so far, stop reason "interrupted"; the next call continues from
        them. A second Ctrl-C raises KeyboardInterrupt; after any exception the session's next
        call starts afresh."""
        vocab = self.backend.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise EdgeMTPError(f"prompt ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        if not prompt:
            raise EdgeMTPError("the prompt is empty")
        if len(prompt) >= self.backend.max_context:
            raise EdgeMTPError(
                f"the prompt has {len(prompt)} tokens; this model's context holds "
                f"{self.backend.max_context} (export with a larger --max-context)"
            )
        policy = self.policy(mtp)
        common = 0
        for a, b in zip(self.cached, prompt[:-1], strict=False):  # one prompt token stays new
            if a != b:
                break
            common += 1
        self.truncate(common)
        stops = self.stop_ids if stop_ids is None else stop_ids
        try:
            with stop_on_interrupt(interruptible) as interrupted:
                result = decode(
                    self.backend,
                    prompt,
                    max_new_tokens,
                    policy=policy,
                    params=params,
                    stop_ids=stops,
                    reused=len(self.cached),
                    on_tokens=on_tokens,
                    should_stop=interrupted,
                )
        except BaseException:
            self.cached = []  # the cache is in an unknown state: the next call starts afresh
            self.backend.truncate(0)
            raise
        self.cached = [*prompt, *result.tokens[:-1]]  # the last token is not in the cache yet
        return result

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached tokens (a chat rolled back); when a sliding ring no
        longer holds them, the next `generate` prefills its prompt from the start."""
        if length >= len(self.cached):
            return
        keeps = self.backend.truncate(length)
        self.cached = self.cached[:length] if keeps else []

    def reset(self) -> None:
        self.backend.truncate(0)
        self.cached = []


@contextmanager
def stop_on_interrupt(enabled: bool = True) -> Iterator[Callable[[], bool]]:
    """Within: the first SIGINT (Ctrl-C) only sets a flag the decode loop reads between rounds;
    a second raises KeyboardInterrupt as usual. Off the main thread, or where the program has
    its own SIGINT handler, signals are left alone."""
    if (
        not enabled
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    asked: list[int] = []

    def ask(signum: int, frame: object) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)

    signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _check_delegate_override(backend: str, exported: str, delegate: str) -> None:
    if delegate == exported:
        return
    if backend == "onnx" and delegate == "cpu":
        return  # a QDQ (htp) graph runs on the CPU EP too
    if backend == "coreml" and delegate in ("cpu", "metal", "npu"):
        return  # compute units are chosen at load
    raise EdgeMTPError(
        f"this {backend} bundle was exported for --delegate {exported}; its program cannot run "
        f"on {delegate}: export it again with --delegate {delegate}"
    )


def open_runner(
    program: Path,
    backend: str,
    delegate: str,
    shapes: StaticShapes,
    threads: int | None = 1,
    weight_cache: bool = True,
) -> Runner:
    """The runner that executes a bundle's methods with its backend's runtime."""
    if backend == "executorch":
        from edgemtp.runtime.runners.executorch import ExecuTorchRunner

        return ExecuTorchRunner(program, shapes, threads=threads, weight_cache=weight_cache)
    if backend == "onnx":
        from edgemtp.runtime.runners.onnx import OnnxRunner

        return OnnxRunner(program, shapes, provider=delegate, threads=threads or 1)
    if backend == "coreml":
        from edgemtp.runtime.capabilities import coreml_compute_units
        from edgemtp.runtime.runners.coreml import CoreMLRunner

        return CoreMLRunner(program, shapes, coreml_compute_units(delegate))
    raise EdgeMTPError(f"unknown backend '{backend}' in the manifest; export the bundle again")
