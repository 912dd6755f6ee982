"""Mismatch monitoring and the response-length-surge learning-rate scheduler."""
