"""cpu-fast's native C kernels: the source, its build and load (``native.py``), and the
tensor-level calls into them (``calls.py``)."""
