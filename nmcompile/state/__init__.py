"""What a declared weight carries, and where it is kept.

- :mod:`.records`: the per-module tables of recipe records (``WeightAnnotation``) and deploy
  records, keyed by parameter name; state access that settles meta-device placeholders.
- :mod:`.clock`: optimizer-step counters as 0-d state tensors with a Python mirror.
- :mod:`.trace`: a record's mask series (flip rate, SAD, STEP's Z_t) kept as device tensors.
- :mod:`.sharding`: full/local views of FSDP2 and DTensor weights.

This stage imports nothing of nmcompile but itself: every other stage may read it.
"""
