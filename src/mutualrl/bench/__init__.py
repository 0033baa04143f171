"""Benchmarks shipped with the package: ``mutualrl bench retokenize`` and what it measures against.

A top-layer package, so the library layers hold no measurement code: ``retokenize`` holds the
retokenizer alone, and this package times it (``retokenize.py``), runs the peers' aligners beside
it (``baselines.py``) and holds the floors it is measured against (``floor.py``), which are written
apart from the retokenizer's own path, from the library's primitives.
"""
