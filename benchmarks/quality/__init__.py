"""The quality study: do the recipes deliver what their papers claim (see ../README.md)."""
