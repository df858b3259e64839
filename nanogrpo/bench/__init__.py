"""Benchmarks (``nanogrpo bench ...``): each module exposes ``main(argv) -> int``."""
