"""Training on this machine: the embedded default target (data, tokenizer, pre-training) and
distilling MTP drafters for any Gemma 4 target."""
