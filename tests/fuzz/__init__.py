"""Fuzz targets, seeds and regression inputs; see tests/README.md."""
