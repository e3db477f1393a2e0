"""The dialects users bring: Accelerate's YAML and flags, DeepSpeed's JSON, torchrun's flags, Horovod's API.

Each maps onto phalanx's own settings and calls. A value phalanx cannot honour is an error that names the key and
what to use instead; a key that has no meaning here is accepted and reported as ignored, with why.
"""
