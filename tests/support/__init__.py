"""Helpers tests share, through the public surfaces of scd's objects."""
