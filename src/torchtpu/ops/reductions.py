"""reductions ops."""
