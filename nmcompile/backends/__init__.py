"""Backends: ``nmsparse`` (the Dynamo backend). Imported lazily; nothing here runs at import of nmcompile."""
