"""Framework adapters; see the adapter modules."""
