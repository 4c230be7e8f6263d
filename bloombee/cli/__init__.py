"""Console entry points; each module's main() is one installed script."""
