"""Plain helpers the test modules share, through the public surfaces of scd's objects
(pytest's fixtures stay in tests/conftest.py)."""
