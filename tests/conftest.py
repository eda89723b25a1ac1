import os

# Tests run on the CPU with one device; multi-device tests start subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
