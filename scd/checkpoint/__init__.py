"""Checkpoint bundles: layout, save (one cut + async writer), restore, offline verify."""
