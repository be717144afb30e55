import os

# Tests run on CPU with 8 fake devices so sharding tests can build meshes; must precede jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
