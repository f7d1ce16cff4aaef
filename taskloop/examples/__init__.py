"""Example workflows shipped with taskloop (used by ``taskloop demo``)."""
