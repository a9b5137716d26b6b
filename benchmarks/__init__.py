"""nmcompile's benchmark scripts (not installed with the package): see README.md, the index.

Each subfolder holds the scripts of one kind of measurement; ``toolbox`` what they share.
"""
