"""Root conftest: makes `python -m pytest` from any checkout import that checkout's package."""
