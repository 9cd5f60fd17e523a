"""Conformance vectors: every decision of greedy decoding on a bundle, in token space, for the
app-side decode engines (`apps/core`) to replay without a model.

    vectors = record_vectors("bundle/")          # runs the bundle: the engine users run
    write_vectors(vectors, Path("vectors/"))     # vectors/vectors.json, all or nothing
    replay_vectors(vectors)                      # the same engine again, on the recorded outputs

The vectors hold what the Python runtime really did: prefill chunks, verify methods and their
padding, draft steps, drafted tokens, the target's argmax rows, accepted counts, committed
tokens, truncations and stop reasons. The model's outputs in them (first token, drafted tokens,
argmax rows) are enough to drive a replay; everything else is a decision the replaying engine
must make identically.

- `scenarios`: which prompts, depths and stop tokens are decoded; the method-choice tables
- `record`: the recording backend, and `record_vectors`
- `vectors`: the file format, writing and reading `vectors.json`
- `replay`: `replay_vectors`, the Python engine over the recorded outputs
- `manifest`: `manifest_mismatches`, an app core's reading of a manifest against Python's
"""

from edgemtp.runtime.conformance.manifest import manifest_mismatches
from edgemtp.runtime.conformance.record import record_vectors
from edgemtp.runtime.conformance.replay import (
    ConformanceMismatch,
    ReplayConfig,
    TokenIdTables,
    replay_vectors,
)
from edgemtp.runtime.conformance.vectors import (
    check_out,
    read_vectors,
    vectors_text,
    write_vectors,
)

__all__ = [
    "ConformanceMismatch",
    "ReplayConfig",
    "TokenIdTables",
    "check_out",
    "manifest_mismatches",
    "read_vectors",
    "record_vectors",
    "replay_vectors",
    "vectors_text",
    "write_vectors",
]
