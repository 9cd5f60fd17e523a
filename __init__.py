"""edgemtp: export and run Gemma 4 edge models with their MTP drafters."""

__version__ = "0.1.0"
