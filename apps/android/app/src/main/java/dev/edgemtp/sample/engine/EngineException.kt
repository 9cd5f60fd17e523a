package dev.edgemtp.sample.engine

/** An error of the native engine (a refused bundle, a bad prompt, a failed method), in one line. */
class EngineException(message: String) : RuntimeException(message)
