"""Plain helpers the test modules share (pytest's fixtures stay in tests/conftest.py)."""
