"""dsa-jax public API."""
