import gc
import os

import pytest

# Tests run on CPU with 8 fake devices so sharding tests can build meshes; must precede jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's caches after each test module. They keep every program compiled in the process
    alive, engines long gone included, and each holds memory mappings of its own: the suite with the
    shared data reached the kernel's limit of 65,530 (vm.max_map_count) and XLA crashed compiling
    (one engine of the tiny test model and one with bursts: ~7,300 mappings, freed only by
    jax.clear_caches)."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()
