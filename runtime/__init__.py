"""Reference decoding engine: KV cache, prefill pruning, sampling, MTP, traces."""
