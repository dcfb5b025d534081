"""Imported first by each benchmark script (run as ``python benchmarks/<script>.py``, which puts this folder
on sys.path): puts the checkout's root first too, so the lora_ops measured is this checkout's, not an
installed copy. ``HERE`` and ``REPO`` are the two folders."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)
