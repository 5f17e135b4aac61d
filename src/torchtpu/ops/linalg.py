"""linalg ops."""
