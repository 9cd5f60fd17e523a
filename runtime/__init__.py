"""The decoding engine (AR, MTP, sampling) over the reference model or a bundle: backends and
runners, reading a bundle, the capability table, edgemtp's kernels, bench and probes."""
