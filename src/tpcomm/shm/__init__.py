"""The CPU shared-memory engine: segments and the collectives over them."""
