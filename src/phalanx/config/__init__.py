"""Configuration, the ground floor: every setting declared once, layered, checked, and read in other tools' dialects.

- ``options.py``           how a group of settings is declared: a dataclass of ``option(default, doc, choices)``
- ``general.py``           the settings every strategy reads (strategy, precision, accumulation, seeds, runtime)
- ``strategy_options.py``  each strategy's own settings (data parallel, zero, pipeline)
- ``registry.py``          strategies by name: their classes (loaded on use) and the option groups each accepts
- ``settings.py``          EngineConfig and its layering: defaults < file < ``PHALANX_*`` env < flags or arguments
- ``flags.py``             the command-line flags made from those declarations (``phalanx launch --help``)
- ``dialects/``            Accelerate YAML and flags, DeepSpeed JSON, torchrun flags, DummyOptim/DummyScheduler

Nothing here imports the rest of phalanx: every other layer may read settings.
"""
